"""The package's layers import only downward, and the light modules stay light.

Layers, top to bottom (docs/architecture.md): server adapters and the entry points (the offline
LLM, orca-serve) -> engine (front, output processor) -> core (scheduler, K/V bookkeeping, the loop)
-> executor -> worker -> model -> distributed -> shared plain modules (config, the model families,
messages, the scheduler output, sampling params with the structured-output spec, tokenizer, net,
LoRA adapters' registry) and the kernels. A module may import its own layer or any layer below it,
never one above.

Only the model families (orca_backend/families/) name a checkpoint architecture; every other module
asks them.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "orca_backend"
# Each Python package's folder, named as it imports; kernels/ and client/ are the product's
# top-level folders around theirs (docs/architecture.md, "Layers").
PACKAGE_FOLDERS = {
    "orca_backend": PACKAGE,
    "orca_kernels": ROOT / "kernels" / "orca_kernels",
    "orca_client": ROOT / "client" / "orca_client",
}

# Rank of every orca_backend module or subpackage: higher ranks sit above lower ones.
LAYERS: dict[str, int] = {
    "orca_backend.server": 8,
    "orca_backend.entrypoints": 8,  # the offline LLM (llm.py) and orca-serve (serve.py)
    "orca_backend": 8,  # the package's lazy public names
    "orca_backend.engine": 7,
    "orca_backend.core": 6,
    "orca_backend.executor": 5,
    "orca_backend.worker": 4,
    "orca_backend.model": 3,
    "orca_backend.distributed": 2,
    "orca_backend.kv_groups": 1,
    "orca_backend.config": 1,
    "orca_backend.families": 1,
    "orca_backend.messages": 1,
    "orca_backend.scheduler_output": 1,
    "orca_backend.processes": 1,
    "orca_backend.sampling_params": 1,
    "orca_backend.quantization": 1,
    "orca_backend.tokenizer": 1,
    "orca_backend.net": 1,
    "orca_backend.lora": 1,
    "orca_backend.wire": 1,
    "orca_kernels": 0,
}


def layer_of(module: str) -> str:
    """The longest LAYERS key that is `module` or one of its parents."""
    parts = module.split(".")
    for end in range(len(parts), 0, -1):
        name = ".".join(parts[:end])
        if name in LAYERS:
            return name
    raise KeyError(f"{module} belongs to no layer: add it to LAYERS and docs/architecture.md")


def module_name(path: Path) -> str:
    rel = path.relative_to(ROOT).with_suffix("")
    parts = list(rel.parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(path: Path) -> list[tuple[int, str]]:
    """(line, module) for every orca_backend / orca_kernels import in the file, lazy ones included."""
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
            found.append((node.lineno, node.module))
            # `from orca_backend import engine` imports the subpackage itself.
            found += [(node.lineno, f"{node.module}.{alias.name}") for alias in node.names
                      if f"{node.module}.{alias.name}" in LAYERS]
    return [(line, name) for line, name in found if name.split(".")[0] in ("orca_backend", "orca_kernels")]


def upward_imports(paths: list[Path]) -> list[str]:
    violations = []
    for path in paths:
        here = module_name(path)
        rank = LAYERS[layer_of(here)]
        for line, target in imported_modules(path):
            if LAYERS[layer_of(target)] > rank:
                violations.append(f"{path.relative_to(ROOT)}:{line}: {here} imports {target}, a layer above it")
    return violations


def test_every_module_belongs_to_a_layer():
    for path in PACKAGE.rglob("*.py"):
        layer_of(module_name(path))


def test_no_module_imports_a_layer_above_it():
    assert upward_imports(sorted(PACKAGE.rglob("*.py"))) == []


def test_every_package_sits_in_a_folder_named_as_it_imports():
    """`import orca_kernels.attention` is kernels/orca_kernels/attention.py: the top-level folders
    kernels/ and client/ hold their package and no Python module of their own."""
    for name, folder in PACKAGE_FOLDERS.items():
        assert folder.name == name and (folder / "__init__.py").is_file(), folder
    for top in ("kernels", "client"):
        assert sorted(p.name for p in (ROOT / top).glob("*.py")) == [], top
        assert sorted(p.parent.name for p in (ROOT / top).glob("*/__init__.py")) == [f"orca_{top}"]


def test_the_installed_packages_are_this_trees_folders():
    """An editable install (pip install -e .) maps each import name onto its folder here."""
    origins = [Path(importlib.util.find_spec(name).origin).resolve() for name in PACKAGE_FOLDERS]
    if not all(origin.is_relative_to(ROOT) for origin in origins):
        pytest.skip("the packages are installed from elsewhere (not an editable install of this tree)")
    assert origins == [(folder / "__init__.py").resolve() for folder in PACKAGE_FOLDERS.values()]


def test_kernels_import_nothing_of_the_engine():
    for path in PACKAGE_FOLDERS["orca_kernels"].rglob("*.py"):
        assert not [t for _, t in imported_modules(path) if t.startswith("orca_backend")], path


def test_a_planted_upward_import_is_caught(tmp_path):
    """The check itself: a worker module importing the engine front must be reported."""
    planted = PACKAGE / "worker" / "_planted_for_test.py"
    planted.write_text("from orca_backend.engine.llm_engine import LLMEngine\n")
    try:
        (violation,) = upward_imports([planted])
        assert "orca_backend.worker._planted_for_test imports orca_backend.engine.llm_engine" in violation
    finally:
        planted.unlink()


# The engine front and the server contract are what Triton's stub process imports: the model, and torch
# with it, live in the engine core process only.
@pytest.mark.parametrize("module", ["orca_backend", "orca_backend.config", "orca_backend.families", "orca_backend.messages",
                                    "orca_backend.sampling_params", "orca_backend.lora",
                                    "orca_backend.entrypoints", "orca_backend.entrypoints.serve",
                                    "orca_backend.net", "orca_backend.engine.llm_engine",
                                    "orca_backend.server.protocol", "orca_backend.server.metrics"])
def test_light_modules_do_not_import_torch(module):
    code = f"import sys, {module}; assert 'torch' not in sys.modules, sorted(m for m in sys.modules if 'orca' in m)"
    subprocess.run([sys.executable, "-c", code], check=True)


# The modules a stub loads, package __init__s included (both models' together until issue #40): 30
# before the messages left core/ (issue #27); 18 before the LoRA registry and multi_lora.json reader;
# 20 before the families left config.py; 25 (24 each) before the detokenizer, lora_file.py,
# structured_spec.py and families/base.py merged into their users and the families loaded on demand;
# 17 before server/instances.py (several instances over one engine core, issue #42), 18 before
# server/triton_config.py (auto-complete, model.json; issue #43); 19 before kv_groups.py (the frontend
# checks a request against the K/V groups, issue #47).
STUB_MODULES = {"orca_model": 20, "baseline_model": 20}


@pytest.mark.parametrize("model", sorted(STUB_MODULES))
def test_the_triton_stub_imports_nothing_below_the_engine_front(model):
    """What a served model's stub process loads (it imports one model.py, so one of the two models):
    the adapters, the engine front, the messages (orca_backend/messages.py) and the families'
    registry, never the core, the executor, the workers, the model, a family's module (it loads as the
    model does) or torch; the core process imports those itself."""
    code = f"""
import sys, types
sys.modules["triton_python_backend_utils"] = types.ModuleType("triton_python_backend_utils")
import orca_backend.server.{model}
loaded = sorted(m for m in sys.modules if m.startswith("orca_backend"))
below = [m for m in loaded if m.split(".")[1:2] and m.split(".")[1] in ("core", "executor", "worker", "model",
                                                                      "distributed")]
families = [m for m in loaded if m.startswith("orca_backend.families.")]
assert not below and not families and "torch" not in sys.modules, (below, families, "torch" in sys.modules)
print(len(loaded))
"""
    result = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=False)
    assert result.returncode == 0, result.stderr
    assert int(result.stdout) <= STUB_MODULES[model]


def test_model_config_is_gpt2s_config_under_its_public_name():
    """`orca_backend.ModelConfig`, the public API's name, is families.gpt2.GPT2Config itself."""
    import orca_backend
    from orca_backend.families.gpt2 import GPT2Config

    assert orca_backend.ModelConfig is GPT2Config


def test_the_families_load_on_demand():
    """The registry imports a family's module the first time it is looked up (families/__init__.py):
    the config and the preset names import none, a served model its own (Gemma's builds on Llama's)."""
    code = """
import sys
from orca_backend.config import PRESETS, EngineConfig
def loaded():
    return sorted(m.rsplit(".", 1)[1] for m in sys.modules if m.startswith("orca_backend.families."))
assert "gemma2-tiny" in PRESETS and "gpt2-tiny" in PRESETS and loaded() == [], loaded()
EngineConfig(model="gpt2-tiny").model_config()
assert loaded() == ["gpt2"], loaded()
EngineConfig(model="gemma2-tiny").model_config()
assert loaded() == ["gemma", "gpt2", "llama"], loaded()
"""
    subprocess.run([sys.executable, "-c", code], check=True)


def test_every_family_declares_what_its_registry_line_says():
    """Each REGISTRY line names its module's architectures and presets (a family checks as it loads)."""
    from orca_backend.families import PRESETS, REGISTRY, all_families

    assert [family.name for family in all_families()] == list(REGISTRY)
    assert all(type(config) is family.config_class for family in all_families()
               for config in family.presets.values())  # fmt: skip
    assert list(PRESETS) == [name for family in all_families() for name in family.presets]


def test_the_families_import_only_each_other():
    """config.py, lora.py and the model code read the families; the families read nothing of the
    engine (no cycle with config.py, and no torch) but the quantization_config parser, a leaf."""
    for path in sorted((PACKAGE / "families").rglob("*.py")):
        outside = [t for _, t in imported_modules(path)
                   if not t.startswith("orca_backend.families") and t != "orca_backend.quantization"]  # fmt: skip
        assert outside == [], f"{path.relative_to(ROOT)} imports {outside}"


# A checkpoint architecture as config.json's `architectures` names it, quoted.
ARCHITECTURE_STRING = re.compile(r"[\"'][A-Za-z0-9]+(?:ForCausalLM|LMHeadModel|ForConditionalGeneration)[\"']")
SOURCE_FOLDERS = ("orca_backend", "kernels", "client", "benchmarks")  # tests/ may name architectures


def naming_architectures(paths: list[Path]) -> list[Path]:
    """The files among `paths` that contain an architecture string."""
    return [path for path in paths if ARCHITECTURE_STRING.search(path.read_text())]


def test_only_the_families_name_an_architecture():
    """Adding a family (docs/architecture.md, "Adding a family") touches its families/ module, its
    model code and the registry line: no switch on an architecture string elsewhere."""
    paths = sorted(path for folder in SOURCE_FOLDERS for path in (ROOT / folder).rglob("*.py"))
    found = [path.relative_to(ROOT).as_posix() for path in naming_architectures(paths)]
    assert [path for path in found if not path.startswith("orca_backend/families/")] == []
    assert {"orca_backend/families/gpt2.py", "orca_backend/families/llama.py", "orca_backend/families/gemma.py"} <= set(found)


def test_a_planted_architecture_string_is_caught(tmp_path):
    """The check itself: a module switching on an architecture must be reported, and one that does not, not."""
    planted, clean = tmp_path / "planted.py", tmp_path / "clean.py"
    planted.write_text("def tied(config):\n    return config.architecture == 'Gemma2ForCausalLM'\n")
    clean.write_text("def tied(config):\n    return family_of(config).name == 'gemma'\n")
    assert naming_architectures([planted, clean]) == [planted]
