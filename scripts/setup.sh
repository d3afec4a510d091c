#!/usr/bin/env bash
# Build the project's virtual environment (.venv) from nothing, or check that it
# is up to date.  Run from the repository root, normally as `make setup`.
#
# What it does (docs/install.md explains each step):
#   1. creates .venv with $PYTHON (default python3) and upgrades pip/wheel/setuptools;
#   2. picks an MPI: the system's (MPICC=/path/to/mpicc, or AXONN_SYSTEM_MPI=1 with an
#      mpicc on PATH; mpi4py is then built from source against it) or else the
#      `mpich` wheel from the package index (no root needed) with the binary mpi4py;
#   3. `pip install -e ".[extras,test]"` (plus `.[mpich]` in the wheel case);
#   4. builds mpi4jax from source against that MPI; its CUDA bridge only when the
#      CUDA headers (cuda_runtime.h) are really there, else the CPU bridge alone;
#   5. checks the imports, the package layout, and `mpiexec -n 2` through mpi4py.
# A stamp in .venv records a hash of pyproject.toml, this script and the choices
# above; when it matches, the script says so and returns at once.
#
# Environment:
#   PYTHON=python3.12        interpreter used to create .venv (only when it is created)
#   MPICC=/path/to/mpicc     use this (system) MPI
#   AXONN_SYSTEM_MPI=1       use the system MPI whose mpicc is first on PATH
#   AXONN_FORCE_SETUP=1      ignore the stamp and redo every step
#   AXONN_SKIP_MPI_CHECK=1   skip the `mpiexec -n 2` check (e.g. a login node
#                            where MPI jobs may only be started by the scheduler)
set -euo pipefail

SELF="$(readlink -f -- "${BASH_SOURCE[0]}")"
cd "$(dirname "$SELF")/.."
ROOT="$(pwd)"
VENV="$ROOT/.venv"
VPY="$VENV/bin/python"
STAMP="$VENV/.axonn_setup_stamp"
MPI_STAMP="$VENV/.axonn_mpi_choice"

say()  { printf 'setup: %s\n' "$*"; }
warn() { printf 'setup: WARNING: %s\n' "$*" >&2; }
die()  { printf 'setup: ERROR: %s\n' "$*" >&2; exit 1; }

# A requirement string from pyproject.toml ("mpi4py>=4.0,<5"), so the ranges live
# in one place; falls back to the given default if the name is not found there.
req() {
    local name="$1" default="$2" found
    found="$(grep -oE "\"${name}[[:space:]]*[<>=!~][^\"]*\"" pyproject.toml | head -n1 | tr -d '"' || true)"
    printf '%s\n' "${found:-$default}"
}

# ---------------------------------------------------------------------------
# MPI choice
MPI_MODE=wheel
SYS_MPICC=""
if [[ -n "${MPICC:-}" ]]; then
    MPI_MODE=system
    SYS_MPICC="$(command -v -- "$MPICC" || true)"
    [[ -n "$SYS_MPICC" ]] || die "MPICC='$MPICC' is not an executable"
elif [[ "${AXONN_SYSTEM_MPI:-0}" == 1 ]]; then
    MPI_MODE=system
    # First mpicc on PATH that is not the one the mpich wheel put into .venv/bin.
    IFS=: read -r -a _path_dirs <<<"${PATH:-}"
    for d in "${_path_dirs[@]}"; do
        [[ -n "$d" && -x "$d/mpicc" ]] || continue
        [[ "$(cd "$d" 2>/dev/null && pwd -P)" == "$(cd "$VENV/bin" 2>/dev/null && pwd -P)" ]] && continue
        SYS_MPICC="$d/mpicc"
        break
    done
    [[ -n "$SYS_MPICC" ]] || die "AXONN_SYSTEM_MPI=1 but no mpicc on PATH (try 'module load' your MPI first)"
fi
if [[ "$MPI_MODE" == system ]]; then
    SYS_MPICC="$(readlink -f -- "$SYS_MPICC")"
    MPI_KEY="system:$SYS_MPICC"
else
    MPI_KEY="wheel"
fi

# ---------------------------------------------------------------------------
# CUDA detection: does any candidate CUDA root hold cuda_runtime.h?
has_cuda_headers() {  # $1 = candidate root; echoes the include dir
    local root="$1" inc
    [[ -n "$root" && -d "$root" ]] || return 1
    if [[ -f "$root/include/cuda_runtime.h" ]]; then
        echo "$root/include"; return 0
    fi
    for inc in "$root"/targets/*/include; do
        if [[ -f "$inc/cuda_runtime.h" ]]; then
            echo "$inc"; return 0
        fi
    done
    return 1
}

CUDA_MODE=cpu
CUDA_ROOT_FOUND=""
CUDA_INC_FOUND=""
NVCC="$(command -v nvcc || true)"
# The roots mpi4jax itself would consider: CUDA_PATH/CUDA_ROOT, else nvcc's parent,
# else (no nvcc) /usr/local/cuda; plus CUDA_HOME and nvcc's real (symlink-resolved) home.
candidates=("${CUDA_PATH:-}" "${CUDA_HOME:-}" "${CUDA_ROOT:-}")
if [[ -n "$NVCC" ]]; then
    candidates+=("$(dirname "$(dirname "$NVCC")")" "$(dirname "$(dirname "$(readlink -f "$NVCC")")")")
else
    candidates+=(/usr/local/cuda)
fi
for c in "${candidates[@]}"; do
    if inc="$(has_cuda_headers "$c")"; then
        CUDA_MODE=gpu
        CUDA_ROOT_FOUND="$(readlink -f "$c")"
        CUDA_INC_FOUND="$inc"
        break
    fi
done
# CUDA from the nvidia-cuda-* wheels in .venv (e.g. after `pip install jax[cuda13]`):
# mpi4jax prefers these to any CUDA_PATH.
for sp in "$VENV"/lib/python3*/site-packages; do
    if [[ -d "$sp/nvidia/cuda_nvcc" && -d "$sp/nvidia/cuda_runtime" ]]; then
        CUDA_MODE=gpu
        CUDA_ROOT_FOUND=""
        CUDA_INC_FOUND="$sp/nvidia/cuda_runtime/include"
    fi
done
if [[ "$CUDA_MODE" == cpu ]]; then
    if [[ -n "$NVCC" ]]; then
        CUDA_REASON="nvcc is $NVCC but there is no cuda_runtime.h under its parent ($(dirname "$(dirname "$NVCC")")), \$CUDA_PATH, \$CUDA_HOME or \$CUDA_ROOT"
        if [[ "$(dirname "$(dirname "$NVCC")")" != /usr/local/cuda ]] && has_cuda_headers /usr/local/cuda >/dev/null; then
            CUDA_REASON="$CUDA_REASON; /usr/local/cuda has the headers, so CUDA_PATH=/usr/local/cuda make setup would build the CUDA bridge too"
        fi
    else
        CUDA_REASON="no nvcc on PATH and no cuda_runtime.h under \$CUDA_PATH, \$CUDA_HOME, \$CUDA_ROOT or /usr/local/cuda"
    fi
fi
CUDA_KEY="$CUDA_MODE:$CUDA_ROOT_FOUND"

# ---------------------------------------------------------------------------
# Up to date?
stamp_value() {
    { cat pyproject.toml "$SELF"; printf '%s\n' "$MPI_KEY" "$CUDA_KEY"; } | sha256sum | cut -d' ' -f1
}
WANT="$(stamp_value)"
if [[ "${AXONN_FORCE_SETUP:-0}" != 1 && -x "$VPY" && -f "$STAMP" && "$(cat "$STAMP")" == "$WANT" ]]; then
    say ".venv is up to date (MPI: $MPI_KEY, mpi4jax bridge: $CUDA_MODE); AXONN_FORCE_SETUP=1 redoes it"
    exit 0
fi
rm -f "$STAMP"
T0=$SECONDS

# ---------------------------------------------------------------------------
# 1. The virtual environment
if [[ -e "$VENV" ]] && ! "$VPY" -c 'import sys' >/dev/null 2>&1; then
    [[ -f "$VENV/pyvenv.cfg" ]] || die "$VENV exists but is not a virtual environment; move it away"
    warn ".venv is broken (its python does not start); recreating it"
    rm -rf "$VENV"
fi
if [[ ! -x "$VPY" ]]; then
    PY="${PYTHON:-python3}"
    command -v "$PY" >/dev/null || die "no interpreter '$PY' (set PYTHON=...)"
    "$PY" -c 'import sys; sys.exit(sys.version_info < (3, 10))' \
        || die "$PY is older than Python 3.10"
    say "creating .venv with $("$PY" -c 'import sys; print(sys.executable, sys.version.split()[0])')"
    "$PY" -m venv "$VENV"
    "$VPY" -m pip install --quiet --upgrade pip wheel "$(req setuptools 'setuptools>=69')"
fi
PIP=("$VPY" -m pip --disable-pip-version-check)
export PIP_NO_INPUT=1

# Switching between the wheel MPI and a system MPI (or between two system MPIs):
# drop what was built against the previous one, since pip would otherwise think
# mpi4py/mpi4jax are already satisfied.
if [[ -f "$MPI_STAMP" && "$(cat "$MPI_STAMP")" != "$MPI_KEY" ]]; then
    say "MPI changed ($(cat "$MPI_STAMP") -> $MPI_KEY); removing mpi4jax, mpi4py and mpich from .venv"
    "${PIP[@]}" uninstall --quiet --yes mpi4jax mpi4py mpich >/dev/null 2>&1 || true
    rm -f "$VENV/.axonn_mpi4jax_stamp"
fi

# ---------------------------------------------------------------------------
# 2./3. The project (editable) with its extras, and MPI for Python
BUILD_REQS=("nanobind>=2.2,<4" "cython>=3,<4")
MPI4PY_REQ="$(req mpi4py 'mpi4py>=4.0,<5')"
if [[ "$MPI_MODE" == wheel ]]; then
    say "MPI: the mpich wheel in .venv (set MPICC=... or AXONN_SYSTEM_MPI=1 for the system's)"
    "${PIP[@]}" install --quiet -e ".[extras,test,mpich]" --only-binary=mpi4py "$MPI4PY_REQ" "${BUILD_REQS[@]}"
    MPICC_USE="$VENV/bin/mpicc"
    MPIEXEC="$VENV/bin/mpiexec"
    export PATH="$VENV/bin:$PATH"
else
    say "MPI: system MPI, $SYS_MPICC (mpi4py is built from source against it)"
    "${PIP[@]}" uninstall --quiet --yes mpich >/dev/null 2>&1 || true
    "${PIP[@]}" install --quiet -e ".[extras,test]" "${BUILD_REQS[@]}"
    MPICC="$SYS_MPICC" "${PIP[@]}" install --quiet --no-cache-dir --no-binary=mpi4py "$MPI4PY_REQ"
    MPICC_USE="$SYS_MPICC"
    MPIEXEC="$(dirname "$SYS_MPICC")/mpiexec"
    [[ -x "$MPIEXEC" ]] || MPIEXEC="$(command -v mpiexec || true)"
    export PATH="$(dirname "$SYS_MPICC"):$PATH"
fi
printf '%s\n' "$MPI_KEY" >"$MPI_STAMP"
[[ -x "$MPICC_USE" ]] || die "no mpicc at $MPICC_USE after installing MPI"

# ---------------------------------------------------------------------------
# 4. mpi4jax, built from source against the chosen MPI (never a cached wheel:
#    a wheel cached on another machine may hold the other bridge or MPI).
MPI4JAX_REQ="$(req mpi4jax 'mpi4jax>=0.9,<0.10')"
M4J_KEY="$MPI_KEY|$CUDA_KEY|$("$VPY" -c 'import importlib.metadata as m; print(m.version("mpi4py"), m.version("jaxlib"), m.version("nanobind"))')|$MPI4JAX_REQ"
M4J_STAMP="$VENV/.axonn_mpi4jax_stamp"
if [[ -f "$M4J_STAMP" && "$(cat "$M4J_STAMP")" == "$M4J_KEY" ]] && "$VPY" -c 'import mpi4jax' >/dev/null 2>&1; then
    say "mpi4jax: already built for this MPI/CUDA/jaxlib"
else
    rm -f "$M4J_STAMP"
    (
        export MPI4JAX_BUILD_MPICC="$MPICC_USE"
        if [[ "$CUDA_MODE" == gpu ]]; then
            say "mpi4jax: building the CPU and CUDA bridges (cuda_runtime.h in $CUDA_INC_FOUND)"
            # mpi4jax looks at CUDA_PATH/CUDA_ROOT, then nvcc's parent dir; point it at
            # the root we found unless the user already chose one.
            if [[ -n "$CUDA_ROOT_FOUND" && -z "${CUDA_PATH:-}" && -z "${CUDA_ROOT:-}" ]]; then
                export CUDA_PATH="$CUDA_ROOT_FOUND"
            fi
            if [[ -n "$CUDA_ROOT_FOUND" && "$CUDA_INC_FOUND" != "$CUDA_ROOT_FOUND/include" ]]; then
                export CPPFLAGS="${CPPFLAGS:-} -I$CUDA_INC_FOUND"
            fi
        else
            say "mpi4jax: building the CPU bridge only: $CUDA_REASON"
            # An existing but empty CUDA root makes mpi4jax skip its CUDA bridge.
            mkdir -p "$VENV/.no-cuda"
            export CUDA_PATH="$VENV/.no-cuda" CUDA_ROOT="$VENV/.no-cuda"
        fi
        "${PIP[@]}" uninstall --quiet --yes mpi4jax >/dev/null 2>&1 || true
        "${PIP[@]}" install --quiet --no-cache-dir --no-build-isolation --no-deps \
            --no-binary=mpi4jax "$MPI4JAX_REQ"
    )
    printf '%s\n' "$M4J_KEY" >"$M4J_STAMP"
fi

# ---------------------------------------------------------------------------
# 5. Checks, run from outside the repository so the source tree is not on sys.path.
say "checking imports and the package layout"
CHECK_MODS="jax, flax, optax, mpi4py, mpi4jax"
if [[ -f axonn_jax/__init__.py ]]; then
    CHECK_MODS="$CHECK_MODS, axonn_jax"
else
    warn "axonn_jax/__init__.py does not exist yet; not importing axonn_jax"
fi
(cd "$VENV" && "$VPY" - "$ROOT" "$CHECK_MODS" "$CUDA_MODE" <<'EOF'
import importlib, importlib.util, os, sys, sysconfig

root, mods, cuda_mode = sys.argv[1], sys.argv[2], sys.argv[3]
for m in mods.split(", "):
    importlib.import_module(m)
problems = []
# partitioner/ and runtime/ must be reachable only as axonn_jax.partitioner/.runtime.
for name in ("partitioner", "runtime"):
    if importlib.util.find_spec(name) is not None:
        problems.append(f"a top-level module '{name}' is importable")
    for d in {sysconfig.get_paths()["purelib"], sysconfig.get_paths()["platlib"]}:
        for entry in os.listdir(d):
            if entry == name or entry.startswith(name + "."):
                problems.append(f"'{entry}' is in {d}")
    if os.path.isfile(os.path.join(root, name, "__init__.py")) and "axonn_jax" in mods:
        mod = importlib.import_module(f"axonn_jax.{name}")
        want = os.path.realpath(os.path.join(root, name))
        got = os.path.realpath(os.path.dirname(mod.__file__))
        if got != want:
            problems.append(f"axonn_jax.{name} comes from {got}, not {want}")
import mpi4jax._src.xla_bridge as xb
bridges = sorted(f.split(".")[0] for f in os.listdir(os.path.dirname(xb.__file__))
                 if f.startswith("mpi_xla_bridge_") and f.endswith(".so"))
if "mpi_xla_bridge_cpu" not in bridges:
    problems.append("mpi4jax has no CPU bridge")
if cuda_mode == "gpu" and "mpi_xla_bridge_cuda" not in bridges:
    problems.append("CUDA headers were found but mpi4jax has no CUDA bridge")
if problems:
    sys.exit("setup: ERROR: " + "; ".join(problems))
print(f"setup: imports OK ({mods}); mpi4jax bridges: {', '.join(bridges)}")
EOF
)

if [[ "${AXONN_SKIP_MPI_CHECK:-0}" == 1 ]]; then
    warn "AXONN_SKIP_MPI_CHECK=1: not running the mpiexec check"
else
    [[ -n "$MPIEXEC" && -x "$MPIEXEC" ]] || die "no mpiexec found next to $MPICC_USE or on PATH"
    say "checking '$MPIEXEC -n 2' with mpi4py"
    # Open MPI refuses root and more ranks than cores without these; MPICH ignores them.
    out="$(cd "$VENV" && OMPI_ALLOW_RUN_AS_ROOT=1 OMPI_ALLOW_RUN_AS_ROOT_CONFIRM=1 \
        OMPI_MCA_rmaps_base_oversubscribe=1 PRTE_MCA_rmaps_default_mapping_policy=:oversubscribe \
        timeout 120 "$MPIEXEC" -n 2 "$VPY" -c \
        'from mpi4py import MPI; c = MPI.COMM_WORLD; print(f"hello from rank {c.Get_rank()} of {c.Get_size()}", flush=True)' 2>&1)" \
        || die "mpiexec -n 2 failed (exit $?):"$'\n'"$out"$'\n'"(see docs/install.md, Troubleshooting; AXONN_SKIP_MPI_CHECK=1 skips this check)"
    if ! grep -q 'rank 0 of 2' <<<"$out" || ! grep -q 'rank 1 of 2' <<<"$out"; then
        die "mpiexec -n 2 did not start 2 ranks of one world (mpi4py and mpiexec from different MPIs?):"$'\n'"$out"
    fi
    say "mpiexec OK: $(tr '\n' ' ' <<<"$out")"
fi

printf '%s\n' "$WANT" >"$STAMP"
say "done in $((SECONDS - T0)) s (MPI: $MPI_KEY, mpi4jax bridge: $CUDA_MODE)"
