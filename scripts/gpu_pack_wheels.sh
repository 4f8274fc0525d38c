#!/usr/bin/env bash
# Packs the wheels the GPU checks need into parts that one device call each can carry (64 MiB per call,
# the ~4.4 MB work tree included), in git-ignored folders .gpu1 .gpu2 ... The machine keeps /tmp while warm
# (a short idle time), so the calls run back to back; each call can do other work too.
#
#   bash scripts/gpu_pack_wheels.sh              fla + tilelang + z3, megatron-core, Hydra, tensordict and Ray
#                                                (the folders ../shared/tools/gpu_wheels.sh --ray fills): 3 parts
#   bash scripts/gpu_pack_wheels.sh --vllm       the same without Ray, plus the CUDA vLLM tree
#                                                (gpu_wheels.sh --vllm): 4 parts
#   bash scripts/gpu_pack_wheels.sh --vllm --ray all of it (gpu_wheels.sh --ray --vllm): 6 parts
# On the device, for N parts:
#   calls 1..N-1 (carry .gpuK):  mkdir -p /tmp/gparts && cp .gpuK/part_* /tmp/gparts/
#   call N (carry .gpuN):        cat /tmp/gparts/part_* .gpuN/part_* | tar -xf - -C /tmp &&
#                                python3 -m pip install -q --no-index --no-deps --no-compile --target /tmp/site /tmp/w/*.whl &&
#                                { [ ! -f /tmp/vllm-site.tar.xz ] || tar -xJf /tmp/vllm-site.tar.xz -C /tmp/site; }
#   then:                        export PYTHONPATH=/tmp/site:$PWD
set -euo pipefail
cd "$(git rev-parse --show-toplevel)"
want_vllm= want_ray=
for a in "$@"; do
    case $a in
        --vllm) want_vllm=1 ;;
        --ray) want_ray=1 ;;
        *) echo "usage: $0 [--vllm [--ray]]" >&2; exit 2 ;;
    esac
done
[[ $want_vllm ]] || want_ray=1  # without vLLM the set is the Ray one (the default)
need=(.whl .whlz)
[[ $want_vllm ]] && need+=(.vllmA)
[[ $want_ray ]] && need+=(.rayA .rayB)
for d in "${need[@]}"; do
    [ -d "$d" ] || { echo "missing $d: run ../shared/tools/gpu_wheels.sh${want_ray:+ --ray}${want_vllm:+ --vllm} first" >&2; exit 1; }
done
tmp=$(mktemp -d)
trap 'rm -rf "$tmp"' EXIT
mkdir -p "$tmp/w"
cp .whl/*.whl .whlz/*.whl "$tmp/w/"
members=(w)
if [[ $want_vllm ]]; then
    cat .vllm[A-Z]/part_* > "$tmp/vllm-site.tar.xz"
    members+=(vllm-site.tar.xz)
fi
if [[ $want_ray ]]; then
    cat .rayA/part_* .rayB/part_* > "$tmp/w/ray-2.58.1-cp312-cp312-manylinux2014_x86_64.whl"
    cp .rayB/deps/*.whl "$tmp/w/"
fi
(cd "$tmp" && tar -cf all.tar "${members[@]}")
# as few even parts as keep each call (part + work tree) under 64 MiB
tree=$(git ls-files -z | xargs -0 du -cb | tail -1 | cut -f1)
room=$(( 64 * 1048576 - tree - 1048576 ))
size=$(stat -c %s "$tmp/all.tar")
n=$(( (size + room - 1) / room ))
(cd "$tmp" && split -n "$n" -d all.tar part_)
rm -rf .gpu[0-9]
i=1
for p in "$tmp"/part_*; do
    grep -qx "/.gpu$i/" .git/info/exclude || echo "/.gpu$i/" >> .git/info/exclude
    mkdir ".gpu$i" && mv "$p" ".gpu$i/"
    i=$((i + 1))
done
du -sh .gpu[0-9]
