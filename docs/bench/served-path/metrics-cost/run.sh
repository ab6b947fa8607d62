#!/bin/bash
# Interleaved served-path runs: the tree before the histograms (4fec895, /tmp/oldtree) and after (9baf65b).
cd /work/main
ARGS="--served-path-only --model sp-model --stream-interval 1 --served-path-streams 64,256 --served-path-tokens 64 --served-path-prompt 32 --served-path-repeats 2 --quiet"
for i in 1 2 3; do
  PYTHONPATH=/tmp/oldtree timeout 900 .venv/bin/orca-bench $ARGS --out /tmp/spcost/before$i > /tmp/spcost/before$i.log 2>&1
  timeout 900 .venv/bin/orca-bench $ARGS --out /tmp/spcost/after$i > /tmp/spcost/after$i.log 2>&1
done
echo done
