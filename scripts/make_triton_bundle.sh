#!/usr/bin/env bash
# A Triton release other than the GPU image's, packed to travel to the device machine:
#   usage (here, repo root):  [PTXAS=legacy] bash scripts/make_triton_bundle.sh VERSION DIR
# Downloads the CPython 3.12 x86-64 wheel, keeps what compiling and launching for SM90 needs
# (the AMD backend, CUPTI, Proton, FileCheck, libtriton's debug sections and one of the two
# ptxas go: ~1 GB -> ~235 MB) and writes DIR/triton-VERSION[-legacy].tar.xz (~53-56 MB for
# 3.9.0; the device tool carries 64 MiB a call with the working tree). The ptxas kept is the
# one the release runs for SM90 (3.9: `ptxas-blackwell`, CUDA 13.4), or with PTXAS=legacy
# its other one (3.9: `ptxas`, CUDA 12.9), which SM90 then takes only through
# TRITON_PTXAS_BLACKWELL_PATH. On the device:
#   ALT_TRITON=DIR/triton-VERSION.tar.xz bash scripts/gpu_check.sh MODE
# runs any mode under it (gpu_check.sh unpacks it once per machine, ahead of the image's).
set -euo pipefail
version=${1:?usage: make_triton_bundle.sh VERSION DIR}
dest=${2:?usage: make_triton_bundle.sh VERSION DIR}
work=$(mktemp -d)
trap 'rm -rf "$work"' EXIT
env -u PIP_FIND_LINKS PIP_CONFIG_FILE=/dev/null python3 -m pip download -q --no-deps \
  --only-binary=:all: --python-version 3.12 --implementation cp \
  --platform manylinux_2_27_x86_64 --platform manylinux_2_28_x86_64 \
  --platform manylinux_2_17_x86_64 -d "$work" "triton==$version"
(cd "$work" && python3 -m zipfile -e triton-*.whl pkg)
pkg=$work/pkg
# one ptxas: 3.9 runs `ptxas-blackwell` for every arch >= 90, 3.6-3.8 only from 100 on
nv=$pkg/triton/backends/nvidia
sm90=ptxas other=ptxas-blackwell suffix=
grep -q "arch < 90" "$nv/compiler.py" && sm90=ptxas-blackwell other=ptxas
case ${PTXAS:-default} in
  default) ;;
  legacy) sm90=$other suffix=-legacy ;;
  *) echo "PTXAS=$PTXAS: default or legacy" >&2; exit 2 ;;
esac
find "$nv/bin" -name 'ptxas*' ! -name "$sm90" -delete
rm -rf "$pkg"/triton/backends/amd "$nv"/lib/cupti* \
  "$pkg"/triton/_C/libproton.so "$pkg"/triton/instrumentation "$pkg"/triton/profiler \
  "$pkg"/triton/plugins "$pkg"/triton/FileCheck
strip --strip-unneeded "$pkg"/triton/_C/libtriton.so
chmod +x "$nv"/bin/*  # zipfile drops the mode bits
mkdir -p "$dest"
tar -C "$pkg" -cf - . | xz -9 -T0 > "$dest/triton-$version$suffix.tar.xz"
ls -l "$dest/triton-$version$suffix.tar.xz"
