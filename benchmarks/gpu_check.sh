#!/usr/bin/env bash
# One command for a session with a GPU (docs/gpu.md): on a bare GPU machine that has torch and
# lightning but no package index, install the project and the wheels carried in .whl/
# (benchmarks/gpu_wheels.sh fills it), then run, each part with a time limit, going on past a
# failing part:
#   cuda   the CUDA tests:            pytest -m cuda (the test files that mark tests cuda)
#   suite  the suite (not slow):      pytest -m "not slow and not cuda", one process per folder
#                                     side by side: tests/core tests/lightning tests/wse
#                                     tests/integrations tests/models
#   fit    the main job on the GPU:   lightning-sparse fit (the default recipe, accelerator auto),
#                                     its validation loss and wall time
#   bench  the per-step cost:         python benchmarks/bench_gpu_step.py
# A package the machine lacks after set-up (a wheel missing from the folder, or no folder) skips
# only the parts that need it, named in the table: fit needs jsonargparse (without wandb it writes
# CSV logs instead of W&B's); cuda and suite need pytest (suite hypothesis too), and their tests
# that need jsonargparse, wandb or compressed-tensors skip themselves.
# Every log goes into one folder (--out; default $OUT when set, else ./gpu_check_logs), with a
# summary table at the end (also summary.txt there). About 9 minutes on an H200 in all, inside
# the device tool's 10 minutes per command; --parts picks some.
#
# --dry-run runs anywhere (CI runs it: tests/app/test_gpu_check.py): it checks the Python, the
# wheel folder (when there is one) and the commands, prints the plan, and runs each part in a
# tiny CPU form (collection for the tests, --print_config for the job, the benchmark's
# --quick --device cpu).
# Its figures mean nothing: a dry run's table says only that each command starts.
#
# Usage: bash benchmarks/gpu_check.sh [--dry-run] [--parts cuda,suite,fit,bench] [--out DIR]
#            [--wheels DIR] [--timeout PART=SECONDS ...]
# PYTHON picks the Python (default python3; there it is the one that holds torch).
set -uo pipefail
cd "$(dirname "$0")/.."
repo=$(pwd)

dry=0
parts="cuda,suite,fit,bench"
out=${OUT:-$repo/gpu_check_logs}
wheels=$repo/.whl
declare -A limit=([cuda]=75 [suite]=180 [fit]=160 [bench]=95)
# What each part cannot run without (benchmarks/gpu_wheels.py IMPORTS names them).
declare -A needs=([cuda]="pytest" [suite]="pytest hypothesis" [fit]="jsonargparse" [bench]="")
usage() { sed -n '2,/^set -uo/p' "$0" | sed '$d; s/^# \{0,1\}//'; }
while [ $# -gt 0 ]; do
    case $1 in
        --dry-run) dry=1 ;;
        --parts) parts=$2; shift ;;
        --out) out=$2; shift ;;
        --wheels) wheels=$2; shift ;;
        --timeout)
            part=${2%%=*}
            [ -n "${limit[$part]:-}" ] || { echo "gpu_check: --timeout: no part '$part'"; exit 2; }
            limit[$part]=${2#*=}; shift ;;
        -h | --help) usage; exit 0 ;;
        *) echo "gpu_check: unknown option $1 (--help lists them)"; exit 2 ;;
    esac
    shift
done
for part in ${parts//,/ }; do
    case $part in
        cuda | suite | fit | bench) ;;
        *) echo "gpu_check: --parts: no part '$part' (cuda, suite, fit, bench)"; exit 2 ;;
    esac
done
py=${PYTHON:-python3}
if [[ $py == */* ]]; then  # absolute, since the fit part runs in its own folder (not resolved:
    py=$(cd "$(dirname "$py")" && pwd)/$(basename "$py")  # a venv's python is a symlink)
fi
mkdir -p "$out"
out=$(cd "$out" && pwd)
summary=$out/summary.txt
: >"$summary"
failed=0
suite_dirs="tests/core tests/lightning tests/wse tests/integrations tests/models"

record() {  # PART STATUS SECONDS NOTE
    printf '%-6s %-8s %5ss  %s\n' "$1" "$2" "$3" "$4" | tee -a "$summary"
}

# Runs "$@" for PART with its time limit, output to $out/PART.log; records the outcome.
run_part() {
    local part=$1 note=$2
    shift 2
    local start=$SECONDS status
    echo "gpu_check: $part: $* (limit ${limit[$part]} s, log $out/$part.log)"
    timeout --kill-after=10 "${limit[$part]}" "$@" >"$out/$part.log" 2>&1
    status=$?
    local took=$((SECONDS - start))
    if [ $status -eq 0 ]; then
        record "$part" ok "$took" "$note$(tail -n 1 "$out/$part.log" | cut -c1-120)"
    elif [ $status -eq 124 ] || [ $status -eq 137 ]; then
        record "$part" TIMEOUT "$took" "$note(over ${limit[$part]} s; --timeout $part=N)"
        failed=1
    else
        record "$part" FAILED "$took" "$note(exit $status; tail of $out/$part.log below)"
        tail -n 15 "$out/$part.log" | sed 's/^/    /'
        failed=1
    fi
    return 0
}

# ---------------------------------------------------------------------------- set-up
echo "gpu_check: $( [ $dry = 1 ] && echo 'dry run' || echo run ): parts $parts; logs in $out"
"$py" - "$out/machine.txt" <<'EOF' || { echo "gpu_check: set PYTHON to a Python with torch and lightning"; exit 2; }
import sys
try:
    import lightning
    import torch
except ImportError as err:
    sys.exit(f"gpu_check: {sys.executable}: {err}")
gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "none"
line = (
    f"gpu_check: Python {sys.version.split()[0]}, torch {torch.__version__} (CUDA "
    f"{torch.version.cuda}), lightning {lightning.__version__}, GPU: {gpu}"
)
print(line)
open(sys.argv[1], "w").write(line + "\n")
EOF

if [ $dry = 0 ] && grep -q "GPU: none$" "$out/machine.txt"; then
    echo "gpu_check: torch sees no GPU here: nothing to check (--dry-run runs without one)"
    exit 2
fi
wheel_note=""
if [ -d "$wheels" ]; then
    "$py" benchmarks/gpu_wheels.py check "$wheels" >"$out/wheels.log" 2>&1
    status=$?
    cat "$out/wheels.log"
    if [ $status -ne 0 ]; then  # install what is there; the parts that need the rest are skipped
        echo "gpu_check: the wheel folder is not ready (bash benchmarks/gpu_wheels.sh): going on without what it lacks"
        wheel_note="; wheel folder not ready, see $out/wheels.log"
    fi
elif [ $dry = 0 ]; then
    echo "gpu_check: no wheel folder $wheels: what the machine lacks cannot be installed"
    echo "gpu_check: fill it here with bash benchmarks/gpu_wheels.sh, carry it (docs/gpu.md)"
fi

start=$SECONDS
if [ $dry = 0 ]; then
    # Straight into the machine's Python (it is lent bare and given back), so that every
    # subprocess a test starts finds them whatever PYTHONPATH it sets.
    (
        if [ -d "$wheels" ]; then
            "$py" -m pip install --no-index --no-deps --quiet "$wheels"/*.whl || exit 1
        fi
        "$py" -m pip install --no-index --no-deps --no-build-isolation --quiet -e . || exit 1
    ) >"$out/setup.log" 2>&1
    status=$?
else
    status=0
fi
if [ $status -ne 0 ]; then
    record setup FAILED $((SECONDS - start)) "pip install (see $out/setup.log)"
    tail -n 15 "$out/setup.log"
    exit 1
fi
# The packages the parts use that this Python cannot import, or the wheel folder cannot install
# (a dry run installs nothing: the folder says what a real run would lack).
declare -A lacks=()
"$py" benchmarks/gpu_wheels.py missing "$wheels" >"$out/missing.log" 2>&1 || {
    record setup FAILED $((SECONDS - start)) "benchmarks/gpu_wheels.py missing (see $out/missing.log)"
    exit 1
}
while IFS=$'\t' read -r package why; do
    [ -n "$package" ] && lacks[$package]=$why
done <"$out/missing.log"
note=$([ $dry = 1 ] && echo "dry run: nothing installed" || echo "installed")
if [ -d "$wheels" ]; then  # versions the image holds that a wheel does not accept
    "$py" benchmarks/gpu_wheels.py installed "$wheels" >"$out/versions.log" 2>&1 \
        || note="$note; version conflicts, see $out/versions.log"
fi
without=$(printf '%s\n' "${!lacks[@]}" | sort | paste -sd' ' -)
record setup ok $((SECONDS - start)) "$note$wheel_note${without:+; without: $without}"
# The optional packages whose tests skip themselves, for the test parts' notes.
skipping=""
for package in jsonargparse wandb compressed-tensors; do
    [ -n "${lacks[$package]:-}" ] && skipping="${skipping:+$skipping, }$package"
done
tests_note=${skipping:+"(without $skipping: their tests skip) "}
bin=$("$py" -c "import os, sys; print(os.path.dirname(sys.executable))")
export PATH="$bin:$PATH" WANDB_MODE=offline WANDB_SILENT=true

# ---------------------------------------------------------------------------- the parts
if [ $dry = 1 ]; then
    echo "gpu_check: the plan on a GPU machine (each part's limit in seconds):"
    for part in ${parts//,/ }; do
        case $part in
            cuda) command="$py -m pytest -q -m cuda \$(grep -rl --include='test_*.py' mark.cuda tests)" ;;
            suite) command="$py -m pytest -q -rf -m 'not slow and not cuda' DIR, one per folder of $suite_dirs, side by side" ;;
            fit) command="(cd $out/fit_run && $py -m lightning_sparse.app.cli fit)" ;;
            bench) command="$py benchmarks/bench_gpu_step.py" ;;
        esac
        printf '  %-6s %4s  %s\n' "$part" "${limit[$part]}" "$command"
    done
    echo "gpu_check: now each part in a tiny CPU form:"
fi
for part in ${parts//,/ }; do
    for package in ${needs[$part]}; do
        if [ -n "${lacks[$package]:-}" ]; then
            record "$part" SKIPPED 0 "needs $package: ${lacks[$package]}"
            continue 2
        fi
    done
    case $part in
        cuda)
            # Only the files that mark a test cuda: all of tests/ is slow to collect, and tests/app
            # imports the command (jsonargparse) as it is collected.
            mapfile -t cuda_files < <(grep -rl --include='test_*.py' "mark.cuda" tests)
            if [ $dry = 1 ]; then
                run_part cuda "${tests_note}collected: " "$py" -m pytest -q --collect-only -p no:cacheprovider -m cuda "${cuda_files[@]}"
            else
                run_part cuda "$tests_note" "$py" -m pytest -q -p no:cacheprovider -m cuda "${cuda_files[@]}"
            fi ;;
        suite)
            if [ $dry = 1 ]; then
                # Every folder is there; one small one collected with the suite's selection (the
                # whole suite is what CI runs anyway).
                for dir in $suite_dirs; do
                    [ -d "$dir" ] || { record suite FAILED 0 "no folder $dir"; failed=1; continue 2; }
                done
                run_part suite "${tests_note}collected: " "$py" -m pytest -q --collect-only -p no:cacheprovider -m "not slow and not cuda" tests/models
            else
                # One pytest per folder, side by side (the machine has 16 cores; one process
                # alone got through half the suite in 200 s on the H200), each with its own log
                # suite_<folder>.log; suite.log gets each one's last line and its failures.
                # shellcheck disable=SC2086
                run_part suite "$tests_note" bash -c '
                    py=$1 out=$2; shift 2
                    for dir in "$@"; do
                        "$py" -m pytest -q -rf -p no:cacheprovider -m "not slow and not cuda" \
                            "$dir" >"$out/suite_${dir##*/}.log" 2>&1 &
                    done
                    status=0
                    for job in $(jobs -p); do wait "$job" || status=1; done
                    for dir in "$@"; do
                        grep "^FAILED\|^ERROR" "$out/suite_${dir##*/}.log"
                    done
                    for dir in "$@"; do
                        echo "$dir: $(tail -n 1 "$out/suite_${dir##*/}.log")"
                    done
                    exit $status' "$py" "$out" $suite_dirs
            fi ;;
        fit)
            mkdir -p "$out/fit_run"
            in_run_dir=(bash -c 'cd "$0" && exec "$@"' "$out/fit_run")
            fit_args=() fit_note=""
            if [ -n "${lacks[wandb]:-}" ]; then  # the recipe's WandbLogger needs it
                fit_args=(--trainer.logger CSVLogger)
                fit_note="CSV logs, no wandb: ${lacks[wandb]}; "
            fi
            if [ $dry = 1 ]; then
                run_part fit "${fit_note}config parses; " "${in_run_dir[@]}" "$py" -m lightning_sparse.app.cli fit "${fit_args[@]}" --print_config
            else
                run_part fit "$fit_note" "${in_run_dir[@]}" "$py" -m lightning_sparse.app.cli fit "${fit_args[@]}"
                # The run's validation loss (its summary.json), beside the part's wall time.
                "$py" - "$out/fit_run" <<'EOF' | tee -a "$summary"
import json, pathlib, sys
found = sorted(pathlib.Path(sys.argv[1]).glob("outputs/**/summary.json"), key=lambda p: p.stat().st_mtime)
if found:
    val = json.loads(found[-1].read_text())["val"]
    print(f"fit    val loss {val['loss']} at step {val['step']} ({found[-1]})")
else:
    print("fit    no summary.json: the run did not finish")
EOF
            fi ;;
        bench)
            if [ $dry = 1 ]; then
                run_part bench "" "$py" benchmarks/bench_gpu_step.py --quick --device cpu
            else
                run_part bench "" "$py" benchmarks/bench_gpu_step.py
            fi ;;
    esac
done

echo
echo "gpu_check: summary ($summary)"
cat "$summary"
exit $failed
