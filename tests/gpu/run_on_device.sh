#!/usr/bin/env bash
# The GPU suite (and the GPU benchmarks) on a machine with a CUDA GPU, CuPy and
# a CUDA build of torch: tests/gpu/README.md says what each stage covers and how
# to get MPI there. Run from anywhere; it works in the repository root.
#
#   bash tests/gpu/run_on_device.sh [STAGE...]
#     env     what is there: GPU, torch, CuPy, mpi4py and its MPI, `domainpar info`
#     serial  pytest tests/gpu -m "not mpi" (the CUDA pack kernels, NVRTC and fatbin)
#     n1 n2 n4  tests/run_mpi.py -n N tests/gpu (N ranks sharing the GPU(s))
#     bench   `domainpar bench halo|conv --device cuda` (staged, and direct where MPI
#             is CUDA-aware)
#   default: env serial n1 n2 n4. Each stage's log and the benchmarks' JSON go to
#   $OUT (default build/gpu-out; at most 8 files, what the device tool brings back);
#   ranks 1..N-1 log to build/gpu-ranks/nN/ (run_mpi prints a failing rank's tail).
#
# MPI from wheels: if .whl/ holds wheels (mpi4py, an MPI such as mpich, pytest-mpi;
# README.md), they are installed under /tmp/domainpar-mpi (once per machine) and
# put first on the paths; otherwise the machine's own mpi4py, MPI and pytest-mpi
# are used. Exit status: 0 when every stage passed, else the number that failed.
set -uo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")/../.."
OUT=${OUT:-build/gpu-out}
mkdir -p "$OUT"
PY=${PYTHON:-python3}
stages=("$@")
[ ${#stages[@]} -gt 0 ] || stages=(env serial n1 n2 n4)

prefix=/tmp/domainpar-mpi
if compgen -G ".whl/*.whl" >/dev/null; then
    if [ ! -e "$prefix/.done" ]; then
        "$PY" -m pip install -q --no-index --no-deps --no-compile --prefix "$prefix" .whl/*.whl \
            || { echo "run_on_device: installing .whl/*.whl failed"; exit 1; }
        touch "$prefix/.done"
    fi
    site=$("$PY" -c 'import sys, sysconfig; p = sys.argv[1]; v = {"base": p, "platbase": p}
print(sysconfig.get_path("platlib", vars=v) + ":" + sysconfig.get_path("purelib", vars=v))' "$prefix")
    export PYTHONPATH="$site${PYTHONPATH:+:$PYTHONPATH}" PATH="$prefix/bin:$PATH"
    for lib in "$prefix"/lib/libmpi.so.12 "$prefix"/lib/libmpi.so.40; do
        [ -e "$lib" ] && export MPI4PY_LIBMPI="$lib" && break
    done
fi
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}" PYTHONUNBUFFERED=1
export OMP_NUM_THREADS=${OMP_NUM_THREADS:-2}

failed=0
summary=()
stage() {  # stage NAME CMD...: run, keep its output in $OUT/NAME.log, remember the outcome
    local name=$1; shift
    echo "=== $name: $*"
    local t0=$SECONDS
    "$@" 2>&1 | tee "$OUT/$name.log"
    local rc=${PIPESTATUS[0]}
    [ "$rc" -eq 0 ] || failed=$((failed + 1))
    summary+=("$(printf '%-12s rc=%-3s %4ss  %s' "$name" "$rc" $((SECONDS - t0)) \
        "$(grep -v '^\s*$' "$OUT/$name.log" | tail -n1 | cut -c1-150)")")
}

env_report() {
    nvidia-smi -L || true
    "$PY" - <<'EOF' || return 1
import sys, torch, cupy, numpy, mpi4py
from mpi4py import MPI
print("python", sys.version.split()[0], "| torch", torch.__version__, "CUDA", torch.version.cuda,
      torch.cuda.is_available(), "| cupy", cupy.__version__, cupy.cuda.runtime.getDeviceCount(),
      "GPU(s) | numpy", numpy.__version__, "| mpi4py", mpi4py.__version__)
print("MPI:", MPI.Get_library_version().splitlines()[0])
EOF
    command -v mpiexec && "$PY" -c "import pytest_mpi" && "$PY" -m domainpar.cli info
}

bench_has_device() {
    "$PY" -m domainpar.cli bench "$1" --help 2>/dev/null | grep -q -- "--device"
}

bench() {
    local aware
    aware=$(env -u DOMAINPAR_CUDA_AWARE "$PY" -c \
        'from domainpar.comm import runtime; print(int(bool(runtime.cuda_aware_mpi()[0])))')
    for what in halo conv; do
        if ! bench_has_device "$what"; then
            echo "bench $what: no --device option yet (domainpar/bench); skipped"
            continue
        fi
        for forced in 0 1; do
            [ "$forced" = 1 ] && [ "$aware" != 1 ] && { echo "bench $what direct: MPI is not CUDA-aware; skipped"; continue; }
            local way=$([ "$forced" = 1 ] && echo direct || echo staged)
            DOMAINPAR_CUDA_AWARE=$forced "$PY" -m domainpar.cli bench "$what" --device cuda \
                --out "$OUT/bench-$what-$way.json" || return 1
        done
    done
}

for s in "${stages[@]}"; do
    case $s in
        env) stage env env_report ;;
        serial) stage serial "$PY" -m pytest -p no:cacheprovider -q -rs -m "not mpi" tests/gpu ;;
        n[0-9]*) stage "$s" "$PY" tests/run_mpi.py -n "${s#n}" -q -rs --log-dir "build/gpu-ranks/$s" \
                     tests/gpu ;;
        bench) stage bench bench ;;
        *) echo "run_on_device: unknown stage $s"; failed=$((failed + 1)) ;;
    esac
done
echo "=== summary"
printf '%s\n' "${summary[@]}"
exit "$failed"
