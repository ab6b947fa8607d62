"""How a model's Triton instances meet (server/instances.py), without a server: one claims the core,
the others wait for it and attach, and a failed owner fails them with a reason instead of a hang."""

from __future__ import annotations

import os
import shutil
import tempfile
import threading
from pathlib import Path

import pytest

from orca_backend.messages import CoreAddress
from orca_backend.server.instances import CoreRendezvous, instance_count


@pytest.fixture
def root():
    """Short, as the real one (/tmp/orca-<uid>) is: an AF_UNIX path holds at most 107 bytes."""
    directory = Path(tempfile.mkdtemp(prefix="rv", dir="/tmp"))
    yield directory / "rv"
    shutil.rmtree(directory, ignore_errors=True)


def test_exactly_one_instance_claims_the_core_until_it_releases_it(root):
    instances = [CoreRendezvous("orca", "1", server_pid=123, root=root) for _ in range(3)]
    claims = [instance.claim() for instance in instances]
    assert claims == [True, False, False]
    instances[0].release()
    assert instances[2].claim()  # a later load of the model (the first instance is gone)


def test_instances_of_other_models_or_servers_do_not_meet(root):
    first = CoreRendezvous("orca", "1", server_pid=123, root=root)
    assert first.claim()
    assert CoreRendezvous("orca", "2", server_pid=123, root=root).claim()
    assert CoreRendezvous("other", "1", server_pid=123, root=root).claim()
    assert CoreRendezvous("orca", "1", server_pid=124, root=root).claim()


def test_a_waiting_instance_attaches_once_the_owners_core_listens(root):
    owner = CoreRendezvous("orca", "1", server_pid=7, root=root)
    waiting = CoreRendezvous("orca", "1", server_pid=7, root=root)
    assert owner.claim() and not waiting.claim()
    tried: list[CoreAddress] = []
    listening = threading.Event()

    def attach(address: CoreAddress) -> str:
        tried.append(address)
        if not listening.is_set():
            raise ConnectionError("not yet")  # a stale socket file, say
        return "attached"

    stale = owner.directory / "core.sock"
    stale.write_text("")  # left by a killed core: the owner replaces it
    address = owner.owner_address()
    assert not stale.exists() and len(address.authkey) == 32
    assert os.stat(owner.directory / "core.key").st_mode & 0o777 == 0o600
    stale.write_text("")  # the core "listens"
    timer = threading.Timer(0.3, listening.set)
    timer.start()
    assert waiting.wait_for_core(attach) == "attached"
    assert tried[-1] == address  # the owner's key, read from the file


def test_a_waiting_instance_fails_with_a_reason_when_the_owner_lets_go_first(root):
    owner = CoreRendezvous("orca", "1", server_pid=8, root=root)
    waiting = CoreRendezvous("orca", "1", server_pid=8, root=root)
    assert owner.claim() and not waiting.claim()
    threading.Timer(0.3, owner.release).start()  # its load failed: no core will ever listen
    with pytest.raises(RuntimeError, match="failed to load, or went away"):
        waiting.wait_for_core(lambda address: pytest.fail("nothing listens"))


def test_a_long_model_name_still_gives_a_socket_path_unix_accepts(root):
    rendezvous = CoreRendezvous("m" * 200, "1", server_pid=9, root=root)
    assert len(str(rendezvous.directory / "core.sock")) <= 100
    with pytest.raises(RuntimeError, match="set TMPDIR to a shorter one"):
        CoreRendezvous("orca", "1", server_pid=9, root=root / ("d" * 100))


def test_a_directory_others_can_enter_is_refused(root):
    root.mkdir(mode=0o755)
    os.chmod(root, 0o755)
    with pytest.raises(RuntimeError, match="mode 0700"):
        CoreRendezvous("orca", "1", server_pid=10, root=root)


@pytest.mark.parametrize(("groups", "count"), [
    (None, 1),
    ([{"count": 1, "kind": "KIND_CPU"}], 1),
    ([{"count": 4, "kind": "KIND_CPU"}], 4),
    ([{"count": 2, "kind": "KIND_MODEL"}, {"count": 1, "kind": "KIND_CPU"}], 3),
    ([{"count": 2, "kind": "KIND_GPU", "gpus": [0, 1, 2]}], 6),
    ([{"count": 1, "kind": "KIND_GPU"}], 1),  # one per visible GPU, a number config.pbtxt does not say
])  # fmt: skip
def test_instance_count_reads_config_pbtxts_instance_groups(groups, count):
    config = {} if groups is None else {"instance_group": groups}
    assert instance_count(config) == count
