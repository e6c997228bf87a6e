#!/bin/bash
# Issue 19's first run, timed: a fresh venv, `pip install <checkout>[demo]` with an empty pip
# cache, then `fabric demo` from an empty directory in a clean environment. Run it as a
# non-root user (e.g. `su - someone -c "bash /path/to/benchmarks/first_run.sh /path/to/checkout"`
# with a copy of the checkout that user can read). Uses ~/first-run as its scratch folder.
set -uo pipefail
checkout=${1:?usage: first_run.sh CHECKOUT}
work=$HOME/first-run
echo "user $(id -un) uid $(id -u); $(/usr/bin/python3.11 --version); $(nproc) cores"
rm -rf "$work" && mkdir -p "$work/run"
echo "load before set-up: $(cut -d' ' -f1-3 /proc/loadavg)"
t0=$(date +%s.%N)
PIP_NO_CACHE_DIR=1 /usr/bin/python3.11 -m venv "$work/venv" &&
  PIP_NO_CACHE_DIR=1 "$work/venv/bin/pip" install -q "$checkout[demo]" > "$work/pip.log" 2>&1
rc=$?
t1=$(date +%s.%N)
echo "set-up (venv + pip install checkout[demo]) rc=$rc: $(echo "$t1 - $t0" | bc) s; load: $(cut -d' ' -f1-3 /proc/loadavg)"
cd "$work/run"
env -i HOME="$HOME" PATH="$work/venv/bin:/usr/bin:/bin" LANG=C.UTF-8 TERM=dumb fabric demo > "$work/demo.log" 2>&1
rc=$?
t2=$(date +%s.%N)
echo "fabric demo rc=$rc: $(echo "$t2 - $t1" | bc) s; load: $(cut -d' ' -f1-3 /proc/loadavg)"
echo "total $(echo "$t2 - $t0" | bc) s"
grep -E "time per step|every scenario|mismatch" "$work/demo.log"
