#!/usr/bin/env bash
# Packs every wheel the GPU checks need (Ray + its missing deps, fla + tilelang + z3, megatron-core, Hydra,
# tensordict: the folders ../shared/tools/gpu_wheels.sh --ray fills) into three parts of ~54 MiB, .gpu1 .gpu2
# .gpu3 (git-ignored), because one device call carries at most 64 MiB. Three calls back to back (the machine
# keeps /tmp while warm) then install everything; each call can do other work too (building checkpoints needs
# only the image's torch and transformers):
#   call 1 (carry .gpu1):  mkdir -p /tmp/gparts && cp .gpu1/part_00 /tmp/gparts/
#   call 2 (carry .gpu2):  cp .gpu2/part_01 /tmp/gparts/
#   call 3 (carry .gpu3):  cat /tmp/gparts/part_00 /tmp/gparts/part_01 .gpu3/part_02 | tar -xf - -C /tmp &&
#                          python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl
#   then:                  export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
for d in .whl .whlz .rayA .rayB; do
    [ -d "$d" ] || { echo "missing $d: run ../shared/tools/gpu_wheels.sh --ray first" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/w"
cat .rayA/part_* .rayB/part_* > "$tmp/w/ray-2.58.1-cp312-cp312-manylinux2014_x86_64.whl"
cp .rayB/deps/*.whl .whl/*.whl .whlz/*.whl "$tmp/w/"
(cd "$tmp" && tar -cf all.tar w && split -n 3 -d all.tar part_)
for i in 1 2 3; do
    grep -qx "/.gpu$i/" .git/info/exclude || echo "/.gpu$i/" >> .git/info/exclude
    rm -rf ".gpu$i" && mkdir ".gpu$i" && mv "$tmp/part_0$((i - 1))" ".gpu$i/"
done
du -sh .gpu1 .gpu2 .gpu3
