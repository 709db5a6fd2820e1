#!/usr/bin/env python3
"""alloctramp benchmarks: measures every figure of docs/benchmarks.md.

Run through bench/run, which builds the release binary and installs the
tools first. `bench/run` (or `bench/run all`) runs every part and writes
docs/benchmarks.md; `bench/run PART...` runs some parts and prints their
tables. BENCH_QUICK=1 runs small sizes (and writes its document elsewhere).
"""

import datetime
import hashlib
import json
import os
import platform
import random
import re
import shlex
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
import traceback

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
AT = os.path.join(ROOT, "target", "release", "alloctramp")
QUICK = os.environ.get("BENCH_QUICK") == "1"


def setting(name, full, quick):
    """A size: BENCH_<NAME> from the environment, else the full or quick default."""
    v = os.environ.get(name)
    return type(full)(v) if v else (quick if QUICK else full)


RUNS = setting("BENCH_RUNS", 5, 3)  # timed runs per variant (median)
MORE_RUNS = setting("BENCH_MORE_RUNS", 6, 0)  # further runs of the unpatched and patched variants (not the tools)
LOOP_PAIRS = setting("BENCH_LOOP_PAIRS", 10_000_000, 1_000_000)  # 1 thread
LOOP8_PAIRS = setting("BENCH_LOOP8_PAIRS", 2_000_000, 200_000)  # per thread, 8 threads
CXX_ROUNDS = setting("BENCH_CXX_ROUNDS", 200, 20)
CC1_UNITS = setting("BENCH_CC1_UNITS", 8, 1)
GIT_FILES = setting("BENCH_GIT_FILES", 3000, 300)
CALLGRIND_PAIRS = setting("BENCH_CALLGRIND_PAIRS", 100_000, 20_000)  # and twice as many
STARTUP_RUNS = setting("BENCH_STARTUP_RUNS", 1000, 200)
LIVE_OBJECTS = setting("BENCH_LIVE_OBJECTS", 1_000_000, 100_000)
DHAT_LIMIT = setting("BENCH_DHAT_LIMIT", 30.0, 10.0)  # seconds for one DHAT run
SWITCHES = 8
LIFETIMES = [1, 8, 64, 256, 4096, 65536, 1_000_000]
LIFE_PAIRS = setting("BENCH_LIFE_PAIRS", 5_000_000, 1_000_000)  # wall time, per W
LIFE_CALLGRIND = setting("BENCH_LIFE_CALLGRIND", 200_000, 50_000)  # and twice as many
REDIS_KEYS = setting("BENCH_REDIS_KEYS", 3_000_000, 300_000)
REDIS_REQUESTS = setting("BENCH_REDIS_REQUESTS", 2_000_000, 200_000)



def log(msg):
    print(f"[{time.strftime('%H:%M:%S')}] {msg}", file=sys.stderr, flush=True)


# ---------------------------------------------------------------------------
# Results: sections of the document, and the targets table.


class Section:
    def __init__(self, title, part, intro=""):
        self.title, self.part, self.lines = title, part, []
        if intro:
            self.para(intro)

    def para(self, text):
        self.lines += [text.strip(), ""]

    def table(self, headers, rows):
        self.lines.append("| " + " | ".join(headers) + " |")
        self.lines.append("|" + "---|" * len(headers))
        for r in rows:
            self.lines.append("| " + " | ".join(str(c).replace("|", "\\|") for c in r) + " |")
        self.lines.append("")

    def markdown(self):
        return f"## {self.title} (`bench/run {self.part}`)\n\n" + "\n".join(self.lines)


SECTIONS = []
TARGETS = []  # (figure, value, target, status, section title)


def target(sec, figure, value, goal, ok):
    """One row of the targets table. ok: True, False, or None (not measurable)."""
    status = "n/a" if ok is None else ("met" if ok else "**MISSED**")
    TARGETS.append((figure, value, goal, status, sec.title))
    return status


# ---------------------------------------------------------------------------
# Running programs.

WORK = None  # the run's scratch directory (on tmpfs when there is one)


def base_env(extra=None):
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ALLOCTRAMP", "BENCH_")) and k != "LD_PRELOAD"}
    env["ALLOCTRAMP_DIR"] = os.path.join(WORK, "counters")
    env["LC_ALL"] = "C"
    env.update(extra or {})
    return env


def clear_counters():
    d = os.path.join(WORK, "counters")
    shutil.rmtree(d, ignore_errors=True)
    os.mkdir(d, 0o700)


class TimedOut(Exception):
    pass


def timed(argv, env, cwd=None, out=None, timeout=None, stdin=None):
    """Runs argv; returns (seconds, peak RSS in KiB). Raises on failure or timeout.
    The peak RSS comes from /usr/bin/time: a child forked from this (large)
    Python process would report the parent's RSS as its own peak."""
    err_path = os.path.join(WORK, "stderr.txt")
    rss_path = os.path.join(WORK, "rss.txt")
    argv_shown, argv = argv, ["/usr/bin/time", "-f", "%M", "-o", rss_path, *argv]
    with open(out or os.devnull, "wb") as so, open(err_path, "wb") as se:
        t0 = time.perf_counter()
        p = subprocess.Popen(argv, env=env, cwd=cwd, stdout=so, stderr=se, stdin=stdin or subprocess.DEVNULL, start_new_session=True)
        fired = []
        timer = None
        if timeout:
            def kill():
                fired.append(1)
                os.killpg(p.pid, signal.SIGKILL)
            timer = threading.Timer(timeout, kill)
            timer.start()
        p.wait()
        secs = time.perf_counter() - t0
        if timer:
            timer.cancel()
    if fired:
        raise TimedOut(f"over {timeout:.0f} s")
    if p.returncode != 0:
        with open(err_path, "rb") as f:
            tail = f.read()[-600:].decode(errors="replace")
        raise RuntimeError(f"{shlex.join(argv_shown)}: exit status {p.returncode}: {tail}")
    with open(rss_path) as f:
        return secs, int(f.read().split()[-1])


def output(argv, env=None, cwd=None):
    return subprocess.run(argv, env=env, cwd=cwd, check=True, capture_output=True, text=True).stdout


def med(xs):
    return statistics.median(xs)


def show(argv):
    """A command line as shown in the document: scratch paths as $W."""
    return shlex.join(argv).replace(WORK, "$W")


def cached(fn):
    memo = {}

    def wrapper(*args, **kwargs):
        key = (args, tuple(sorted(kwargs.items())))
        if key not in memo:
            memo[key] = fn(*args, **kwargs)
        return memo[key]

    return wrapper


@cached
def build(src, *flags, name=None):
    """Compiles bench/SRC into $W/NAME (NAME: SRC's stem unless given); returns its path."""
    name = name or os.path.splitext(src)[0]
    exe = os.path.join(WORK, name)
    compiler = "g++" if src.endswith(".cpp") else "gcc"
    subprocess.run([compiler, "-O2", os.path.join(ROOT, "bench", src), "-o", exe, *flags], check=True)
    return exe


@cached
def patched(path):
    """Patches PATH into $W/patched/ (the runtime copy beside it); returns
    (path, seconds, peak RSS KiB, sites patched)."""
    d = os.path.join(WORK, "patched")
    os.makedirs(d, exist_ok=True)
    out = os.path.join(d, os.path.basename(path))
    secs, rss = timed([AT, "patch", path, "-o", out], base_env())
    with open(os.path.join(WORK, "stderr.txt")) as f:
        m = re.search(r"\((\d+) sites patched", f.read())
    return out, secs, rss, int(m.group(1)) if m else 0


@cached
def patched_libstdcxx():
    """Patches the libstdc++ g++ links with into $W/patched/libstdc++.so.6; returns
    (the original's path, the environment that makes patched programs load the copy)."""
    lib = output(["g++", "-print-file-name=libstdc++.so.6"]).strip()
    out = patched(lib)[0]
    assert os.path.basename(out) == "libstdc++.so.6"
    return os.path.realpath(lib), {"LD_LIBRARY_PATH": os.path.dirname(out)}


def callgrind(argv, env, toggle=None, per_object=False):
    """Instructions executed by ARGV (valgrind --tool=callgrind): the total (only
    inside function TOGGLE and its callees if given), or with PER_OBJECT a dict
    of totals per group of objects (see part_instructions)."""
    out = os.path.join(WORK, "callgrind.out")
    cmd = ["valgrind", "--tool=callgrind", f"--callgrind-out-file={out}"] + ([f"--toggle-collect={toggle}"] if toggle else [])
    r = subprocess.run(cmd + argv, env=env, capture_output=True, text=True)
    m = re.search(r"Collected : (\d+)", r.stderr)
    if not m or r.returncode != 0:
        raise RuntimeError(f"callgrind {show(argv)}: {r.stderr[-600:]}")
    if not per_object:
        return int(m.group(1))
    groups = {}
    for line in output(["callgrind_annotate", "--threshold=100", "--inclusive=no", out]).splitlines():
        mm = re.match(r"^\s*([\d,]+) .*\[([^\[\]]+)\]\s*$", line)
        if not mm:
            continue
        obj = os.path.basename(mm.group(2))
        if obj == os.path.basename(argv[0]) or obj.startswith("libstdc++"):
            g = "program and libstdc++ (patched)"
        elif obj.startswith("libc.so"):
            g = "libc (malloc, memcmp, ...)"
        elif obj.startswith("liballoctramp_rt"):
            g = "alloctramp runtime"
        else:
            g = "dynamic linker and others"
        groups[g] = groups.get(g, 0) + int(mm.group(1).replace(",", ""))
    return groups


def read_header(path):
    """What a process file says of the runtime, as `alloctramp report --format json` gives it (docs/formats.md)."""
    out = subprocess.run([AT, "report", "--format", "json", "--quiet", path], env=base_env(), check=True,
                         capture_output=True, text=True).stdout
    doc = json.loads(out)
    h = {
        "live": doc["live"], "switch_ns": doc["last_switch_ns"], "switch_sites": doc["last_switch_sites"],
        "table_bytes": doc["table_bytes"], "table_objects": doc["table_objects"],
        "modules": [{"table": m["table_size"], "counters": m["counters_size"], "sites": m["sites"]}
                    for m in doc["modules"]],
    }
    st = os.stat(path)
    h["file_size"], h["file_allocated"] = st.st_size, st.st_blocks * 512
    return h


def counters_files(d=None):
    """The counters files in D (default: $W/counters), oldest first (not the shared site tables beside them)."""
    d = d or os.path.join(WORK, "counters")
    return sorted((os.path.join(d, f) for f in os.listdir(d) if f.endswith(".counters")), key=os.path.getmtime)


# ---------------------------------------------------------------------------
# Side-by-side workloads.

VARIANTS = [
    ("unpatched", "unpatched", {}),
    ("off", "patched, profiling off", {}),
    ("count", "patched, on, counting", {"ALLOCTRAMP": "on", "ALLOCTRAMP_LIVE": "0"}),
    ("live", "patched, on, live bytes", {"ALLOCTRAMP": "on"}),
    ("heaptrack", "heaptrack (unpatched)", {}),
    ("dhat", "DHAT (unpatched)", {}),
]
PATCHED = ("off", "count", "live")
VARIANT_ENV = {v: e for v, _, e in VARIANTS}


class Workload:
    """A workload: commands(variant) gives the commands of one run, with the
    program (unpatched or patched) and environment for that variant;
    result() what must be the same in every variant."""

    name = ""

    def commands(self, variant):
        raise NotImplementedError

    def prepare_run(self):
        pass

    def result(self, stdout_path):
        with open(stdout_path, "rb") as f:
            return f.read().decode(errors="replace")

    def same(self, expected, got, variant):
        # heaptrack prints its own lines on stdout, around the program's.
        return expected == got if variant not in ("heaptrack", "dhat") else expected.strip() in got


def wrapper(variant):
    if variant == "heaptrack":
        return ["heaptrack", "-o", os.path.join(WORK, "tool", "heaptrack")]
    if variant == "dhat":
        return ["valgrind", "--tool=dhat", "-q", "--dhat-out-file=" + os.path.join(WORK, "tool", "dhat.out")]
    return []


def run_variant(w, variant, timeout=None):
    """One run of workload W as VARIANT: (seconds, stdout of the last command)."""
    w.prepare_run()
    clear_counters()
    shutil.rmtree(os.path.join(WORK, "tool"), ignore_errors=True)
    os.mkdir(os.path.join(WORK, "tool"))
    out = os.path.join(WORK, "stdout.txt")
    total = 0.0
    deadline = time.perf_counter() + timeout if timeout else None
    for argv, env, cwd in w.commands(variant):
        left = deadline - time.perf_counter() if deadline else None
        if left is not None and left <= 0:
            raise TimedOut(f"over {timeout:.0f} s")
        secs, _ = timed(wrapper(variant) + argv, env, cwd=cwd, out=out, timeout=left)
        total += secs
    return total, w.result(out)


def side_by_side(sec, w, describe):
    """Runs every variant of W RUNS times, in turn, and adds the table to SEC.
    Returns {variant: median seconds} (DHAT missing when skipped)."""
    times = {v: [] for v, _, _ in VARIANTS}
    notes, differs = [], []
    expected = None
    dhat_ok = True
    # The unpatched and patched variants, whose ratios are the targets, run
    # RUNS + MORE_RUNS times (the tools RUNS times): still in turn, so that
    # the machine's load falls on each alike, and enough runs that one
    # disturbed run moves no median.
    rounds = [(r, [v for v, _, _ in VARIANTS]) for r in range(RUNS)]
    rounds += [(RUNS + r, ["unpatched", *PATCHED]) for r in range(MORE_RUNS)]
    labels = {v: label for v, label, _ in VARIANTS}
    for r, variants in rounds:
        for v in variants:
            if v == "dhat" and not dhat_ok:
                continue
            log(f"{w.name}: {labels[v]}, run {r + 1}/{RUNS if r < RUNS else RUNS + MORE_RUNS}")
            try:
                secs, got = run_variant(w, v, timeout=DHAT_LIMIT if v == "dhat" and r == 0 else None)
            except TimedOut:
                dhat_ok = False
                notes.append(f"DHAT skipped: one run did not finish within {DHAT_LIMIT:.0f} s (BENCH_DHAT_LIMIT).")
                continue
            if expected is None:
                expected = got
            elif not w.same(expected, got, v) and v not in differs:
                differs.append(v)
            times[v].append(secs)
    u = med(times["unpatched"])
    rows = []
    medians = {}
    for v, label, _ in VARIANTS:
        if not times[v]:
            rows.append([label, f"`{describe(v)}`", "skipped", "", ""])
            continue
        m = medians[v] = med(times[v])
        rows.append([label, f"`{describe(v)}`", f"{m:.3f}", f"{m / u:.3f}x", " ".join(f"{t:.3f}" for t in times[v])])
    sec.table(["variant", "command", "median s", "vs unpatched", "runs (s)"], rows)
    same = not differs
    target(sec, f"{w.name}: output identical in every variant", "yes" if same else "differs: " + ", ".join(differs), "identical", same)
    for n in notes:
        sec.para(n)
    return medians


def env_of(variant, extra_patched=None):
    """The environment of VARIANT; EXTRA_PATCHED is added for the patched variants."""
    env = base_env(VARIANT_ENV[variant])
    if variant in PATCHED and extra_patched:
        env.update(extra_patched)
    return env


def env_shown(variant, extra_patched=None):
    e = dict(VARIANT_ENV[variant])
    if variant in PATCHED and extra_patched:
        e.update(extra_patched)
    return " ".join(f"{k}={v}" for k, v in e.items()).replace(WORK, "$W")


def describe_simple(w, extra_patched=None):
    def d(v):
        argv = wrapper(v) + w.commands(v)[0][0]
        s = env_shown(v, extra_patched)
        return (s + " " if s else "") + show(argv)

    return d


class Program(Workload):
    """One program run with fixed arguments; its stdout must not change."""

    def __init__(self, name, exe, args, extra_patched=None):
        self.name, self.exe, self.args, self.extra = name, exe, args, extra_patched
        self.patched = patched(exe)[0]

    def commands(self, v):
        return [([self.patched if v in PATCHED else self.exe, *self.args], env_of(v, self.extra), None)]


def overhead_ratio(m, on_variant):
    """heaptrack's overhead over alloctramp's."""
    a, h = m[on_variant] - m["unpatched"], m["heaptrack"] - m["unpatched"]
    if a <= 0:
        return f"heaptrack +{h:.3f} s, alloctramp {a:+.3f} s (within noise)", True
    return f"{h / a:.0f}x (heaptrack +{h:.3f} s, alloctramp +{a:.3f} s)", h / a >= 20


# ---------------------------------------------------------------------------
# Parts.


def part_loop():
    """The malloc/free loop, 1 thread and 8 threads."""
    loop = build("malloc_loop.c", "-pthread")
    sec = Section(
        "malloc/free loop", "loop",
        f"`bench/malloc_loop.c`: malloc of 32-63 bytes, a write, free; {LOOP_PAIRS:,} pairs on 1 thread, "
        f"then {LOOP8_PAIRS:,} pairs on each of 8 threads. Wall time, median of {RUNS + MORE_RUNS} runs ({RUNS} for "
        "the tools), variants in turn.",
    )
    SECTIONS.append(sec)
    w1 = Program("malloc/free loop, 1 thread", loop, [str(LOOP_PAIRS), "1"])
    sec.para(f"**1 thread, {LOOP_PAIRS:,} pairs**")
    m = side_by_side(sec, w1, describe_simple(w1))
    for v, what in (("count", "counting"), ("live", "live bytes")):
        r = m[v] / m["unpatched"]
        target(sec, f"malloc/free loop, 1 thread: wall time, on ({what}) / unpatched", f"{r:.3f}x", "<= 1.5x", r <= 1.5)
    for v, what in (("count", "counting"), ("live", "live bytes")):
        value, ok = overhead_ratio(m, v)
        target(sec, f"malloc/free loop, 1 thread: heaptrack's overhead / alloctramp's ({what})", value, ">= 20x", ok)

    w8 = Program("malloc/free loop, 8 threads", loop, [str(LOOP8_PAIRS), "8"])
    sec.para(f"**8 threads, {LOOP8_PAIRS:,} pairs each** (on {os.cpu_count()} cores)")
    m8 = side_by_side(sec, w8, describe_simple(w8))
    for v, what in (("count", "counting"), ("live", "live bytes")):
        kept = m8["unpatched"] / m8[v]
        target(sec, f"malloc/free loop, 8 threads: throughput on ({what}) / unpatched", f"{100 * kept:.0f}%", ">= 80%", kept >= 0.8)
    for v, what in (("count", "counting"), ("live", "live bytes")):
        value, _ = overhead_ratio(m8, v)
        sec.para(f"8 threads, heaptrack's overhead / alloctramp's ({what}): {value}.")
    sec.para(live_tracking())


def part_lifetimes():
    """Live tracking whatever the live set: objects freed W allocations after they were made."""
    exe = build("lifetime.c", "-pthread")
    pexe = patched(exe)[0]
    n1, n2 = LIFE_CALLGRIND, 2 * LIFE_CALLGRIND
    sec = Section(
        "Live tracking at scale: objects that live", "lifetimes",
        "`bench/lifetime.c W PAIRS [THREADS]`: a ring of W live objects of 16-79 bytes (malloc); each step frees "
        "the oldest and allocates a new one, so every object is freed W allocations after it was made and W "
        f"objects are live throughout. Instructions: `valgrind --tool=callgrind --toggle-collect=work` at {n1:,} "
        f"and {n2:,} steps after the ring is filled, per step: the difference divided by {n2 - n1:,}, patched "
        "minus unpatched (filling and emptying the ring cancel out). Wall time: "
        f"{LIFE_PAIRS:,} steps, median of {RUNS} runs, variants in turn. Memory: peak RSS (`/usr/bin/time`) of "
        "the patched program with live tracking minus the unpatched one, over the objects live.",
    )
    SECTIONS.append(sec)
    rows, worst = [], 0.0
    for w in LIFETIMES:
        ir = {}
        for v in ("unpatched", "count", "live"):
            for n in (n1, n2):
                log(f"callgrind: lifetime W={w}, {v}, {n} steps")
                ir[v, n] = callgrind([pexe if v in PATCHED else exe, str(w), str(n)], env_of(v), toggle="work")
        per = {v: ((ir[v, n2] - ir[v, n1]) - (ir["unpatched", n2] - ir["unpatched", n1])) / (n2 - n1) for v in ("count", "live")}
        t = {v: [] for v in ("unpatched", "count", "live")}
        for r in range(RUNS):
            for v in t:
                log(f"lifetime W={w}: {v}, run {r + 1}/{RUNS}")
                clear_counters()
                t[v].append(timed([pexe if v in PATCHED else exe, str(w), str(LIFE_PAIRS)], env_of(v))[0])
        m = {v: med(x) for v, x in t.items()}
        worst = max(worst, per["live"])
        rows.append([f"{w:,}", f"{per['count']:+.1f}", f"{per['live']:+.1f}", f"{m['unpatched']:.3f}",
                     f"{m['count'] / m['unpatched']:.3f}x", f"{m['live'] / m['unpatched']:.3f}x"])
        if w == LIFETIMES[-1]:
            big = m
    sec.table(["objects live (W)", "extra instructions per step, counting", "extra instructions per step, live bytes",
               "unpatched s", "counting / unpatched", "live bytes / unpatched"], rows)
    sec.para("Commands: `[ALLOCTRAMP=on [ALLOCTRAMP_LIVE=0]] valgrind --tool=callgrind --toggle-collect=work "
             "$W/[patched/]lifetime W N` and `[...] $W/[patched/]lifetime W " + f"{LIFE_PAIRS}`.")
    target(sec, "live bytes: extra instructions per malloc+free pair, worst W from 1 to 1,000,000", f"{worst:+.1f}",
           "<= 60", worst <= 60)
    r = big["live"] / big["unpatched"]
    target(sec, f"live bytes with {LIFETIMES[-1]:,} objects live: wall time / unpatched", f"{r:.3f}x", "<= 1.5x", r <= 1.5)

    # Memory per live object: the ring of 1,000,000 objects, peak RSS.
    objects = LIFETIMES[-1]
    rss = {v: [] for v in ("unpatched", "live")}
    for r in range(RUNS):
        for v in rss:
            clear_counters()
            rss[v].append(timed([pexe if v in PATCHED else exe, str(objects), "0"], env_of(v))[1])
    per_obj = (med(rss["live"]) - med(rss["unpatched"])) * 1024 / objects
    sec.table(["variant", "command", "peak RSS KiB (median)"],
              [["unpatched", f"`/usr/bin/time -f %M $W/lifetime {objects} 0`", f"{med(rss['unpatched']):,}"],
               ["patched, on, live bytes", f"`ALLOCTRAMP=on /usr/bin/time -f %M $W/patched/lifetime {objects} 0`", f"{med(rss['live']):,}"]])
    target(sec, f"live bytes: memory per live object ({objects:,} objects of 16-79 bytes)", f"{per_obj:.1f} bytes", "<= 16 bytes", per_obj <= 16)

    # 8 threads, each with a ring of 1/8 of the objects.
    t8 = {v: [] for v in ("unpatched", "count", "live")}
    steps = LIFE_PAIRS // 4
    for r in range(RUNS):
        for v in t8:
            log(f"lifetime 8 threads: {v}, run {r + 1}/{RUNS}")
            clear_counters()
            t8[v].append(timed([pexe if v in PATCHED else exe, str(objects), str(steps), "8"], env_of(v))[0])
    m8 = {v: med(x) for v, x in t8.items()}
    sec.table(["8 threads, 125,000 objects live each", "command", "median s", "throughput vs unpatched"],
              [[v, f"`{env_shown(v)} $W/{'patched/' if v in PATCHED else ''}lifetime {objects} {steps} 8`", f"{m8[v]:.3f}",
                f"{100 * m8['unpatched'] / m8[v]:.0f}%"] for v in t8])
    for v, what in (("count", "counting"), ("live", "live bytes")):
        kept = m8["unpatched"] / m8[v]
        target(sec, f"lifetime, 8 threads, {objects:,} objects live: throughput on ({what}) / unpatched",
               f"{100 * kept:.0f}%", ">= 80%", kept >= 0.8)
    part_redis(sec)


def part_redis(sec=None):
    """redis-server under redis-benchmark with millions of keys live (in the
    lifetimes section, or a section of its own when run alone)."""
    if sec is None:
        sec = Section("redis-server with millions of keys live", "redis", "The redis-server run of `lifetimes` alone.")
        SECTIONS.append(sec)
    server = shutil.which("redis-server")
    client = shutil.which("redis-benchmark")
    if not server or not client:
        target(sec, "redis-server: throughput with live tracking / unpatched", "redis-server or redis-benchmark missing",
               ">= 90%", False)
        return
    pserver = patched(server)[0]
    port = 16379
    cpus = os.cpu_count() or 1
    pin_server, pin_client = (["taskset", "-c", "0"], ["taskset", "-c", "1"]) if cpus >= 2 else ([], [])
    fill = [client, "-p", str(port), "-q", "-t", "set", "-r", str(REDIS_KEYS), "-n", str(2 * REDIS_KEYS), "-P", "16", "-d", "8"]
    measure = [client, "-p", str(port), "-q", "-t", "set,get", "-r", str(REDIS_KEYS), "-n", str(REDIS_REQUESTS), "-P", "16",
               "-d", "8", "--csv"]

    def one(v):
        clear_counters()
        argv = pin_server + [pserver if v in PATCHED else server, "--port", str(port), "--save", "", "--appendonly", "no",
                             "--bind", "127.0.0.1", "--daemonize", "no"]
        p = subprocess.Popen(argv, env=env_of(v), stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            for _ in range(200):
                if subprocess.run(["redis-cli", "-p", str(port), "ping"], capture_output=True, text=True).stdout.strip() == "PONG":
                    break
                time.sleep(0.05)
            subprocess.run(pin_client + fill, check=True, capture_output=True)
            keys = int(subprocess.run(["redis-cli", "-p", str(port), "dbsize"], capture_output=True, text=True).stdout.strip() or 0)
            out = subprocess.run(pin_client + measure, check=True, capture_output=True, text=True).stdout
            rps = {}
            for line in out.splitlines():
                f = [x.strip('"') for x in line.split(",")]
                if len(f) >= 2 and f[0] in ("SET", "GET"):
                    rps[f[0]] = float(f[1])
            return keys, rps
        finally:
            p.terminate()
            p.wait()

    res = {v: [] for v in ("unpatched", "count", "live")}
    keys = {}
    for r in range(RUNS):
        for v in res:
            log(f"redis: {v}, run {r + 1}/{RUNS}")
            k, rps = one(v)
            keys[v] = k
            res[v].append(rps.get("SET", 0) + rps.get("GET", 0))
    m = {v: med(x) for v, x in res.items()}
    sec.para(
        f"**redis-server** ({output([server, '--version']).split()[2]}, Debian's, its own jemalloc behind zmalloc): "
        f"`{show(fill)}` fills about {keys['unpatched']:,} keys, then `{show(measure)}` measures SET and GET "
        f"(requests per second, summed). The server runs on CPU 0 (`taskset -c 0`) and the client on CPU 1, so "
        f"they never share a core by accident; variants alternate, {RUNS} runs each, median.")
    sec.table(["variant", "keys", "SET+GET requests/s (median)", "vs unpatched", "runs"],
              [[v, f"{keys[v]:,}", f"{m[v]:,.0f}", f"{100 * m[v] / m['unpatched']:.0f}%", " ".join(f"{x:,.0f}" for x in res[v])]
               for v in res])
    for v, what, goal in (("live", "live tracking", 0.90), ("count", "counting", 0.97)):
        kept = m[v] / m["unpatched"]
        target(sec, f"redis-server: throughput with {what} / unpatched", f"{100 * kept:.0f}%", f">= {100 * goal:.0f}%", kept >= goal)


LIVE_CHECKED = []


@cached
def live_tracking():
    """What the runtime does with ALLOCTRAMP=on and with ALLOCTRAMP_LIVE=0 (the
    LIVE flag of the counters file), in words."""
    live = {}
    for v in ("count", "live"):
        clear_counters()
        timed([patched(build("malloc_loop.c", "-pthread"))[0], "1000", "1"], env_of(v))
        files = counters_files()
        live[v] = bool(files) and read_header(files[-1])["live"]
    if live["live"] and not live["count"]:
        text = ("Live tracking: this build's runtime tracks live objects with `ALLOCTRAMP=on` and only counts with "
                "`ALLOCTRAMP_LIVE=0` (the LIVE flag of the counters file).")
    elif not live["live"]:
        text = ("Live tracking: this build's runtime does not track live objects (a run with `ALLOCTRAMP=on` does not "
                "set the LIVE flag of the counters file): `ALLOCTRAMP=on` counts only, like `ALLOCTRAMP_LIVE=0`, so "
                "the live-bytes figures measure counting.")
    else:
        text = ("Live tracking: this build's runtime tracks live objects even with `ALLOCTRAMP_LIVE=0`, so the "
                "counting figures include live tracking.")
    LIVE_CHECKED.append(text)
    return text


def part_cxx():
    exe = build("containers.cpp")
    libstdcxx, extra = patched_libstdcxx()
    sec = Section(
        "C++ containers and strings", "cxx",
        f"`bench/containers.cpp` ({CXX_ROUNDS} rounds): std::string, std::vector, std::map, std::unordered_map and "
        "std::unique_ptr churn, about 14,000 operator new/delete pairs per round, a checksum at the end. The patched "
        f"variants also load a patched copy of libstdc++ ({os.path.basename(libstdcxx)}, through LD_LIBRARY_PATH), "
        "since much of std::string's allocation happens inside it: each operator new is counted at its call site "
        "and again at the malloc call inside operator new. No target is set for this synthetic workload.",
    )
    SECTIONS.append(sec)
    w = Program("C++ containers", exe, [str(CXX_ROUNDS)], extra)
    side_by_side(sec, w, describe_simple(w, {"LD_LIBRARY_PATH": "$W/patched"}))


def cc1plus_path():
    return output(["g++", "-print-prog-name=cc1plus"]).strip()


@cached
def cc1plus_source():
    """A preprocessed C++ source: standard headers and UNITS template-heavy functions."""
    src = os.path.join(WORK, "big.cpp")
    headers = ["bits/stdc++.h", "regex"] if not QUICK else ["string", "vector", "map", "sstream", "algorithm"]
    with open(src, "w") as f:
        f.write("".join(f"#include <{h}>\n" for h in headers))
        if QUICK:
            f.write("#include <unordered_map>\n#include <set>\n#include <numeric>\n#include <iomanip>\n")
        for i in range(CC1_UNITS):
            f.write(f"""
struct S{i} {{ std::string name; std::vector<int> v; std::map<std::string, double> m; }};
std::string f{i}(const std::vector<S{i}> &xs) {{
    std::ostringstream out;
    std::unordered_map<std::string, std::vector<S{i}>> groups;
    for (const auto &x : xs) groups[x.name].push_back(x);
    std::vector<std::pair<std::string, size_t>> sizes;
    for (auto &[k, g] : groups) sizes.emplace_back(k, g.size());
    std::sort(sizes.begin(), sizes.end(), [](auto &a, auto &b) {{ return a.second < b.second || (a.second == b.second && a.first < b.first); }});
    for (auto &[k, s] : sizes) out << k << ':' << s << std::setw({i % 7 + 1}) << {i} << '\\n';
    std::set<int> seen;
    for (const auto &x : xs) for (int e : x.v) seen.insert(e + {i});
    return out.str() + std::to_string(std::accumulate(seen.begin(), seen.end(), 0L));
}}
""")
    ii = os.path.join(WORK, "big.ii")
    subprocess.run(["g++", "-E", src, "-o", ii], check=True)
    return ii


class Cc1plus(Workload):
    name = "cc1plus"

    def __init__(self):
        self.exe = cc1plus_path()
        self.patched = patched(self.exe)[0]
        self.ii = cc1plus_source()
        self.out = os.path.join(WORK, "big.s")

    def args(self):
        return ["-fpreprocessed", self.ii, "-quiet", "-dumpbase", "big.ii", "-dumpbase-ext", ".ii",
                "-mtune=generic", "-march=x86-64", "-O1", "-o", self.out]

    def commands(self, v):
        return [([self.patched if v in PATCHED else self.exe, *self.args()], env_of(v), WORK)]

    def result(self, _stdout):
        with open(self.out, "rb") as f:
            return hashlib.sha256(f.read()).hexdigest()

    def same(self, expected, got, _v):
        return expected == got


def part_cc1plus():
    w = Cc1plus()
    size = os.path.getsize(w.ii)
    sec = Section(
        "The C++ compiler proper, cc1plus", "cc1plus",
        f"`{w.exe}` (patched: {patched(w.exe)[3]:,} sites) compiles a generated, preprocessed source at -O1 "
        f"({size / 1e6:.1f} MB: {'the standard library headers' if not QUICK else 'a few standard headers'} and "
        f"{CC1_UNITS} template-heavy functions). The assembly output must be byte-identical in every variant. "
        "Only cc1plus is patched (not the libraries it loads).",
    )
    SECTIONS.append(sec)
    m = side_by_side(sec, w, describe_simple(w))
    for v, what in (("count", "counting"), ("live", "live bytes")):
        r = m[v] / m["unpatched"]
        target(sec, f"cc1plus: wall time, on ({what}) / unpatched", f"{r:.3f}x", "<= 1.03x", r <= 1.03)


class GitWorkload(Workload):
    name = "git"
    PARTS = 5

    def __init__(self):
        self.git = shutil.which("git")
        self.exec_path = output([self.git, "--exec-path"]).strip()
        self.patched = patched(self.git)[0]
        self.tree = os.path.join(WORK, "gitwork")
        home = os.path.join(WORK, "home")
        os.makedirs(home, exist_ok=True)
        self.env = {
            "HOME": home, "GIT_CONFIG_NOSYSTEM": "1", "GIT_CONFIG_GLOBAL": "/dev/null",
            "GIT_AUTHOR_NAME": "Bench", "GIT_AUTHOR_EMAIL": "bench@example.org", "GIT_AUTHOR_DATE": "2000-01-01T00:00:00Z",
            "GIT_COMMITTER_NAME": "Bench", "GIT_COMMITTER_EMAIL": "bench@example.org",
            "GIT_COMMITTER_DATE": "2000-01-01T00:00:00Z",
        }
        self.generate()

    def generate(self):
        """GIT_FILES text files of 1-4 KB in PARTS directories of 20 subdirectories each."""
        rnd = random.Random(7)
        words = ["".join(rnd.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rnd.randint(2, 10))) for _ in range(2000)]
        for i in range(GIT_FILES):
            d = os.path.join(self.tree, f"p{i % self.PARTS}", f"d{(i // self.PARTS) % 20:02}")
            os.makedirs(d, exist_ok=True)
            with open(os.path.join(d, f"f{i:05}.txt"), "w") as f:
                lines = []
                for _ in range(rnd.randint(20, 80)):
                    lines.append(" ".join(rnd.choice(words) for _ in range(rnd.randint(3, 12))))
                f.write("\n".join(lines) + "\n")

    def prepare_run(self):
        shutil.rmtree(os.path.join(self.tree, ".git"), ignore_errors=True)

    def commands(self, v):
        git = self.patched if v in PATCHED else self.git
        env = base_env({**VARIANT_ENV[v], **self.env})
        if v in PATCHED:  # git's own subprocesses (gc: repack, pack-objects, ...) run the patched git too
            env["GIT_EXEC_PATH"] = os.path.dirname(self.patched)
        cmds = [[git, "init", "-q", "-b", "main"]]
        for k in range(self.PARTS):
            cmds += [[git, "add", f"p{k}"], [git, "commit", "-q", "-m", f"part {k}"]]
        cmds += [[git, "log", "--stat"], [git, "gc", "-q"], [git, "fsck", "--no-progress"], [git, "log", "--oneline"]]
        return [(c, env, self.tree) for c in cmds]

    def result(self, stdout_path):
        with open(stdout_path) as f:
            log_lines = f.read()
        head = output([self.git, "rev-parse", "HEAD"], env=base_env(self.env), cwd=self.tree).strip()
        return head + "\n" + log_lines

    def same(self, expected, got, v):
        # The last command's output is `git log --oneline` (heaptrack adds lines).
        return expected == got if v not in ("heaptrack", "dhat") else all(line in got for line in expected.splitlines())


def part_git():
    w = GitWorkload()
    sec = Section(
        "git on a generated repository", "git",
        f"`{w.git}` (patched: {patched(w.git)[3]:,} sites). One run: `git init`, then {w.PARTS} times `git add` and "
        f"`git commit` of a fifth of {GIT_FILES:,} generated text files, `git log --stat`, `git gc`, `git fsck`, "
        "`git log --oneline`: 15 commands, timed together (the commands are in `GitWorkload.commands` in "
        "bench/bench.py). The commit ids and the log must be identical in every variant. The patched variants set "
        "GIT_EXEC_PATH to the patched git's directory, so git's own subprocesses (gc's repack and pack-objects, "
        "commit's maintenance, ...) are patched and profiled too, each with its own start-up and counters file; "
        "switched on, each maps the switched image of its mode that `alloctramp patch` writes beside the patched "
        "git (`$W/patched/.alloctramp-on/git` for live tracking, `$W/patched/.alloctramp-count/git` for counting "
        "only) instead of copying the code pages that hold sites. "
        "heaptrack and DHAT wrap each of the 15 commands and trace only the process they start.",
    )
    SECTIONS.append(sec)

    def describe(v):
        words = [env_shown(v, {"GIT_EXEC_PATH": "$W/patched"}), show(wrapper(v)), "$W/patched/git" if v in PATCHED else w.git, "..."]
        return " ".join(x for x in words if x)

    m = side_by_side(sec, w, describe)
    for v, what in (("count", "counting"), ("live", "live bytes")):
        r = m[v] / m["unpatched"]
        target(sec, f"git: wall time, on ({what}) / unpatched", f"{r:.3f}x", "<= 1.03x", r <= 1.03)


def part_instructions():
    """Off is free (instruction counts), on costs N instructions per pair."""
    loop = build("malloc_loop.c", "-pthread")
    ploop = patched(loop)[0]
    n1, n2 = CALLGRIND_PAIRS, 2 * CALLGRIND_PAIRS
    sec = Section(
        "Instructions: off is free, on is cheap", "instructions",
        f"`valgrind --tool=callgrind` counts the instructions of the malloc/free loop (1 thread) at {n1:,} and "
        f"{n2:,} pairs, twice: the whole process, and only the loop (`--toggle-collect=work`: the thread function "
        "with everything it calls: malloc, free, trampolines, the runtime). Per-pair figures are the loop's "
        f"difference between the two sizes divided by {n2 - n1:,}, minus the same figure for the unpatched "
        "program, so start-up cancels out. Instruction counts do not depend on the machine's load.",
    )
    SECTIONS.append(sec)
    ir, lp = {}, {}
    for v in ("unpatched",) + PATCHED:
        for n in (n1, n2):
            log(f"callgrind: {v}, {n} pairs")
            argv = [ploop if v in PATCHED else loop, str(n), "1"]
            ir[v, n] = callgrind(argv, env_of(v))
            lp[v, n] = callgrind(argv, env_of(v), toggle="work")
    base = lp["unpatched", n2] - lp["unpatched", n1]
    extra = {v: lp[v, n2] - lp[v, n1] - base for v in PATCHED}
    per = {v: extra[v] / (n2 - n1) for v in PATCHED}
    rows = []
    for v, label, _ in VARIANTS:
        if v not in ("unpatched",) + PATCHED:
            continue
        e = env_shown(v)
        cmd = f"`{e + ' ' if e else ''}valgrind --tool=callgrind [--toggle-collect=work] {'$W/patched/' if v in PATCHED else '$W/'}malloc_loop N 1`"
        rows.append([label, cmd, f"{ir[v, n1]:,}", f"{ir[v, n2]:,}", f"{lp[v, n1]:,}", f"{lp[v, n2]:,}",
                     f"{(lp[v, n2] - lp[v, n1]) / (n2 - n1):.2f}", "" if v == "unpatched" else f"{per[v]:+.2f}"])
    sec.table(["variant", "command", f"process, N={n1:,}", f"process, N={n2:,}", f"loop, N={n1:,}", f"loop, N={n2:,}",
               "loop per pair", "extra per pair"], rows)
    # Off, the loop runs the original instructions of the program; what
    # the C library's malloc and free execute may still move by a few
    # instructions, since the runtime's own start-up allocations give the
    # heap another layout. The target is what alloctramp adds: the
    # instructions of the program's code, the trampolines and the runtime.
    ours = {}
    for v in ("unpatched", "off"):
        for n in (n1, n2):
            log(f"callgrind by object: {v}, {n} pairs")
            g = callgrind([ploop if v in PATCHED else loop, str(n), "1"], env_of(v), toggle="work", per_object=True)
            ours[v, n] = g.get("program and libstdc++ (patched)", 0) + g.get("alloctramp runtime", 0) + g.get(
                "dynamic linker and others", 0)
    ours_extra = (ours["off", n2] - ours["off", n1]) - (ours["unpatched", n2] - ours["unpatched", n1])
    target(sec, "patched, profiling off: extra instructions per malloc+free pair (the program, trampolines and runtime)",
           f"{ours_extra / (n2 - n1):.2f} ({ours_extra:+d} instructions over {n2 - n1:,} more pairs; the whole loop "
           f"with the C library: {extra['off']:+d})", "exactly 0", ours_extra == 0)
    target(sec, "on, counting: extra instructions per malloc+free pair", f"{per['count']:.2f}", "<= 20", per["count"] <= 20)
    target(sec, "on, live bytes: extra instructions per malloc+free pair", f"{per['live']:.2f}", "<= 60", per["live"] <= 60)
    startup_ir = ir["off", n1] - ir["unpatched", n1]
    whole = (ir["off", n2] - ir["off", n1]) - (ir["unpatched", n2] - ir["unpatched", n1])
    sec.para(
        f"Fixed start-up difference, profiling off: {startup_ir:,} instructions for the whole process (the runtime "
        f"loading, registering the module and starting its watcher thread, which makes the counters file 10 ms "
        f"later in a process that lives that long), of which {lp['off', n1] - lp['unpatched', n1]:+,} "
        "inside the loop (where not 0: the heap's layout differs for the thread's first malloc; the same at both "
        f"sizes). Over the whole process, the patched program's two sizes differ by {whole:+,} instructions more "
        "than the unpatched program's (where not 0: start-up varies by a few instructions from run to run).")

    # The same check on C++: operator new/delete in the program and in a patched libstdc++, split by object.
    exe = build("containers.cpp")
    _, lib_env = patched_libstdcxx()
    r1, r2 = (5, 10) if QUICK else (10, 20)
    cx = {}
    for v in ("unpatched", "off"):
        for r in (r1, r2):
            log(f"callgrind: containers {v}, {r} rounds")
            prog = patched(exe)[0] if v == "off" else exe
            cx[v, r] = callgrind([prog, str(r)], env_of(v, lib_env), per_object=True)
    groups = ["program and libstdc++ (patched)", "libc (malloc, memcmp, ...)", "alloctramp runtime", "dynamic linker and others"]
    per_round = {(v, g): (cx[v, r2].get(g, 0) - cx[v, r1].get(g, 0)) / (r2 - r1) for v in ("unpatched", "off") for g in groups}
    sec.table(["C++ containers (`bench/containers.cpp`): instructions per round, by object", "unpatched", "patched, profiling off", "extra"],
              [[g, f"{per_round['unpatched', g]:,.1f}", f"{per_round['off', g]:,.1f}", f"{per_round['off', g] - per_round['unpatched', g]:+,.1f}"]
               for g in groups])
    d = per_round["off", groups[0]] - per_round["unpatched", groups[0]]
    libc = per_round["off", groups[1]] - per_round["unpatched", groups[1]]
    sec.para(
        f"Per round of about 14,000 operator new/delete pairs, measured at {r1} and {r2} rounds. The patched "
        "modules (the program and libstdc++, where every site is) execute exactly the instructions of the "
        f"originals; libc's count differs by {libc:+,.0f} per round (about {libc / 14000:+.1f} per pair) because "
        "the runtime's own allocations at start-up give the heap a different layout (malloc's paths and memcmp's "
        "alignment cases); the runtime's and the dynamic linker's rows vary from run to run (the watcher thread).")
    target(sec, "C++ containers, patched off: extra instructions per round in the patched modules", f"{d:+.2f}", "exactly 0", d == 0)

    # Wall time of start-up: a small program run STARTUP_RUNS times in a row, original and patched, in turn.
    small_c = os.path.join(WORK, "small.c")
    with open(small_c, "w") as f:
        f.write("#include <stdlib.h>\nint main(void){free(malloc(1));return 0;}\n")
    small = os.path.join(WORK, "small")
    subprocess.run(["gcc", "-O2", small_c, "-o", small], check=True)
    psmall = patched(small)[0]
    loop_cmd = 'for ((i = 0; i < $1; i++)); do "$0"; done'
    a, b = [], []
    for r in range(RUNS):
        log(f"start-up: run {r + 1}/{RUNS}")
        for prog, into in ((small, a), (psmall, b)):
            clear_counters()
            into.append(timed(["bash", "-c", loop_cmd, prog, str(STARTUP_RUNS)], base_env())[0] * 1000 / STARTUP_RUNS)
    ta, tb = med(a), med(b)
    sec.table(["start-up (a program that mallocs once)", "command", "ms per run (median)"],
              [["original", f"`{show(['bash', '-c', loop_cmd, small, str(STARTUP_RUNS)])}`", f"{ta:.3f}"],
               ["patched, profiling off", f"`{show(['bash', '-c', loop_cmd, psmall, str(STARTUP_RUNS)])}`", f"{tb:.3f}"]])
    target(sec, "patched, profiling off: start-up time", f"{tb - ta:+.3f} ms per run ({startup_ir:,} instructions)", "<= 1 ms", tb - ta <= 1)

    # Forks: a program that forks a child running /bin/true, waits, and again.
    forks = max(STARTUP_RUNS // 2, 50)
    fork_loop = build("fork_loop.c")
    pfork = patched(fork_loop)[0]
    fork_variants = [("original", fork_loop, {}), ("patched, profiling off", pfork, {}),
                     ("patched, on (live bytes)", pfork, {"ALLOCTRAMP": "on"})]
    per = {name: [] for name, _, _ in fork_variants}
    for r in range(RUNS):
        log(f"forks: run {r + 1}/{RUNS}")
        for name, prog, extra in fork_variants:
            clear_counters()
            per[name].append(float(output([prog, str(forks)], env=base_env(extra)).strip()))
    us = {name: med(v) for name, v in per.items()}
    sec.para(f"`bench/fork_loop.c`: {forks:,} times, fork a child that runs `/bin/true` at once and wait for it (what a "
             "shell, `make` or git does for each command); microseconds per fork and exec, median of "
             f"{RUNS} runs, variants in turn. With the runtime loaded, the process has its watcher thread, and so "
             "does each child (a thread costs a freshly forked process its page copies); a child of a process that "
             "never profiled makes its counters file only some milliseconds later, and so makes none if it runs "
             "another program first. A child forked while profiling is on counts from the fork, so it makes its "
             "file at once.")
    sec.table(["fork and exec of a child", "command", "us per fork (median)", "vs original"],
              [[name, f"`{show(([] if not extra else [f'{k}={v}' for k, v in extra.items()]) + [prog, str(forks)])}`",
                f"{us[name]:.1f}", f"{us[name] - us['original']:+.1f}"] for name, prog, extra in fork_variants])
    off = us["patched, profiling off"] - us["original"]
    target(sec, "patched, profiling off: extra time per fork and exec of a child", f"{off / 1000:+.3f} ms", "<= 0.5 ms",
           off <= 500)


def largest_elf(shared):
    """The largest x86-64 ELF file (SHARED: shared library) under the usual
    directories that imports malloc. BENCH_ELF overrides."""
    if os.environ.get("BENCH_ELF"):
        return os.environ["BENCH_ELF"]
    if QUICK:
        return os.path.realpath(output(["g++", "-print-file-name=libstdc++.so.6"]).strip())
    r = subprocess.run(["find", "/usr/lib", "/usr/lib64", "/usr/bin", "/usr/libexec", "/usr/local", "-xdev", "-type", "f",
                        "-size", "+1M", "-printf", "%s %p\n"], capture_output=True, text=True)
    for line in sorted(r.stdout.splitlines(), key=lambda s: -int(s.split(" ", 1)[0])):
        path = line.split(" ", 1)[1]
        if shared and ".so" not in os.path.basename(path):
            continue
        try:
            with open(path, "rb") as f:
                h = f.read(20)
        except OSError:
            continue
        if len(h) == 20 and h[:6] == b"\x7fELF\x02\x01" and h[16] in (2, 3) and h[18:20] == b"\x3e\x00":
            nm = subprocess.run(["nm", "-D", path], capture_output=True, text=True).stdout
            if re.search(r" U malloc(@|$)", nm, re.M):
                return path
    raise RuntimeError("no x86-64 ELF file importing malloc found")


def which_elf():
    if os.environ.get("BENCH_ELF"):
        return "The file BENCH_ELF names"
    if QUICK:
        return "Quick mode: libstdc++ instead of the largest file"
    return "The largest x86-64 ELF file on the machine that imports malloc"


@cached
def the_largest(shared=False):
    return largest_elf(shared)


def part_scan():
    f = the_largest()
    size = os.path.getsize(f)
    doc = json.loads(output([AT, "sites", "--json", f]))
    summary = doc["summary"]
    code, sites = summary["code_bytes"], summary["sites"]
    wrappers = len(doc["wrappers"])
    sec = Section("Site discovery", "scan",
                  f"{which_elf()}: `{f}` ({size / 2**20:.0f} MiB, "
                  f"{code / 2**20:.0f} MiB of code, {sites:,} sites). `alloctramp sites --no-wrappers` is the site "
                  "scan, with symbolization and printing every line; the page cache is warm. The wrapper search "
                  "(`alloctramp sites` by default) reads every function again, and the libraries the file needs; "
                  "its time is reported without a target; `alloctramp patch` runs it too (it charges wrappers' callers by default), so the patching figures below include it.")
    SECTIONS.append(sec)
    scan = [AT, "sites", "--no-wrappers", f]
    timed(scan, base_env())  # warm the page cache
    runs, rss = [], 0
    for r in range(RUNS):
        log(f"scan: run {r + 1}/{RUNS}")
        secs, rss = timed(scan, base_env())
        runs.append(secs)
    s = med(runs)
    log("scan: with the wrapper search")
    ws, wrss = timed([AT, "sites", f], base_env())
    log("scan: objdump -d")
    od, _ = timed(["objdump", "-d", f], base_env())
    sec.table(["figure", "command", "value"], [
        [f"wall time (median of {RUNS})", f"`alloctramp sites --no-wrappers {f}`", f"{s:.3f} s"],
        ["code scanned per second", "", f"{code / 1e6 / s:.0f} MB/s"],
        ["peak RSS", "", f"{rss / 1024:.1f} MiB"],
        ["with the wrapper search (1 run)", f"`alloctramp sites {f}`",
         f"{ws:.2f} s, {wrss / 1024:.0f} MiB, {wrappers:,} wrappers"],
        ["objdump -d on the same file (1 run)", f"`objdump -d {f}`", f"{od:.2f} s"],
    ])
    TARGETS.append(("wrapper search (`alloctramp sites` without `--no-wrappers`)",
                    f"{ws:.2f} s, {wrss / 1024:.0f} MiB, {wrappers:,} wrappers", "(reported)", "", sec.title))
    target(sec, "scan speed", f"{code / 1e6 / s:.0f} MB/s of code", ">= 100 MB/s", code / 1e6 / s >= 100)
    target(sec, "scan speed-up over `objdump -d`", f"{od / s:.0f}x ({s:.2f} s against {od:.2f} s)", ">= 15x", od / s >= 15)
    limit = size / 2**20 + 64
    target(sec, "scan peak RSS", f"{rss / 1024:.0f} MiB", f"<= file + 64 MiB = {limit:.0f} MiB", rss / 1024 <= limit)


def part_patch():
    f = the_largest()
    size = os.path.getsize(f)
    out = os.path.join(WORK, "patch-test.so")
    runs, rss = [], 0
    for r in range(RUNS):
        log(f"patch: run {r + 1}/{RUNS}")
        secs, rss = timed([AT, "patch", f, "-o", out], base_env())
        runs.append(secs)
    s = med(runs)
    psize = os.path.getsize(out)
    os.unlink(out)
    for image in (".alloctramp-on", ".alloctramp-count"):
        os.unlink(os.path.join(WORK, image, "patch-test.so"))
    sec = Section("Patching", "patch", f"`alloctramp patch` on `{f}` ({size / 2**20:.0f} MiB); the output is "
                  f"{psize / 2**20:.0f} MiB, and each of its two switched images (`$W/.alloctramp-on/out.so` and "
                  "`$W/.alloctramp-count/out.so`, written with it, one after the other on a second thread) the same. "
                  "Peak RSS is the kernel's (`/usr/bin/time`'s maximum resident set): "
                  "it counts the pages of the mapped input the command holds, which it lets go once the analysis "
                  "has read them and as the writers copy them out.")
    SECTIONS.append(sec)
    sec.table(["figure", "command", "value"], [
        [f"wall time (median of {RUNS})", f"`alloctramp patch {f} -o $W/out.so`", f"{s:.2f} s"],
        ["peak RSS", "", f"{rss / 1024:.1f} MiB"],
    ])
    target(sec, "patch the largest ELF file", f"{s:.2f} s ({size / 2**20:.0f} MiB)", "<= 3 s", s <= 3)
    limit = 2 * size / 2**20 + 64
    target(sec, "patch peak RSS", f"{rss / 1024:.0f} MiB", f"<= 2 x file + 64 MiB = {limit:.0f} MiB", rss / 1024 <= limit)


def hold_process(libs):
    """Starts bench/hold.c (patched) with the patched LIBS loaded; returns (process, counters file)."""
    hold = patched(build("hold.c", "-ldl"))[0]
    clear_counters()
    p = subprocess.Popen([hold, *libs], env=base_env(), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    if p.stdout.readline().strip() != "ready":
        raise RuntimeError("hold did not start")
    return p, os.path.join(WORK, "counters", f"{p.pid}.counters")


def part_switch():
    f = the_largest(True)
    plib, _, _, nsites = patched(f)
    p, cfile = hold_process([plib])
    rows, times = [], []
    try:
        for i in range(SWITCHES):
            what = "enable" if i % 2 == 0 else "disable"
            secs, _ = timed([AT, what, "--dir", os.path.join(WORK, "counters"), str(p.pid)], base_env())
            h = read_header(cfile)
            times.append(h["switch_ns"] / 1e6)
            rows.append([str(i + 1), what, f"{h['switch_sites']:,}", f"{h['switch_ns'] / 1e6:.1f}", f"{secs * 1000:.1f}"])
        h = read_header(cfile)
    finally:
        p.stdin.write("\n")
        p.stdin.close()
        p.wait()
    sites = h["switch_sites"]
    sec = Section("Switching", "switch",
                  f"A process (`bench/hold.c`, patched) holds the patched `{os.path.basename(f)}` ({nsites:,} sites); "
                  f"`alloctramp enable` and `disable` switch every site {SWITCHES} times. The switch time is the "
                  "runtime's own measurement (the counters file's last-switch field); the command's wall time includes "
                  "starting `alloctramp` and waiting for the process to answer.")
    SECTIONS.append(sec)
    sec.table(["#", "command", "sites", "switch ms", "command wall ms"], rows)
    first, later = times[0], statistics.mean(times[1:])
    per = lambda t: t * 1000 / sites
    target(sec, f"switch {sites:,} sites on, first time (pages copied on write)", f"{first:.1f} ms = {per(first):.3f} ms per 1,000", "<= 1 ms per 1,000 sites", per(first) <= 1)
    target(sec, f"switch {sites:,} sites on or off, later (mean of {SWITCHES - 1})", f"{later:.1f} ms = {per(later):.3f} ms per 1,000", "<= 1 ms per 1,000 sites", per(later) <= 1)


def part_memory():
    sec = Section("Memory", "memory",
                  "Runtime memory per site: the process counters file holds each module's counters (shards x 64-byte "
                  "cells), from when the module first switches on, and names its site table, of which the counters "
                  "directory holds one copy (`tables/`) for all the processes of a patched file. The runtime reserves "
                  "the storage of every byte a thread may write before it writes (a write fault on a full file system "
                  "would be SIGBUS): shard 0 and the shard of each thread given one. Size is what the file "
                  "spans, allocated what the file system holds (st_blocks); on tmpfs that is memory.")
    SECTIONS.append(sec)
    rows = []
    # A module with many sites, switched on, nothing called yet.
    f = the_largest(True)
    plib = patched(f)[0]
    p, cfile = hold_process([plib])
    try:
        subprocess.run([AT, "enable", "--dir", os.path.join(WORK, "counters"), str(p.pid)], env=base_env(), check=True, capture_output=True)
        h = read_header(cfile)
    finally:
        p.stdin.write("\n")
        p.stdin.close()
        p.wait()
    cases = [(f"`bench/hold.c` holding patched {os.path.basename(f)}, switched on", h)]
    # A program that ran with profiling on (the C++ workload and its patched libstdc++).
    exe = build("containers.cpp")
    _, extra = patched_libstdcxx()
    clear_counters()
    timed([patched(exe)[0], str(CXX_ROUNDS)], env_of("live", extra))
    cases.append((f"`bench/containers.cpp {CXX_ROUNDS}` with patched libstdc++, after a run with profiling on", read_header(counters_files()[-1])))
    for what, h in cases:
        sites = sum(m["sites"] for m in h["modules"])
        table = sum(m["table"] for m in h["modules"])
        counters = sum(m["counters"] for m in h["modules"])
        rows.append([what, f"{sites:,}", f"{table / sites:,.0f}", f"{counters / sites:,.0f}",
                     f"{h['file_size'] / sites:,.0f}", f"{h['file_allocated'] / sites:,.0f}"])
    sec.table(["process", "sites", "site table bytes/site (shared)", "counters reserved bytes/site", "file size bytes/site", "file allocated bytes/site"], rows)
    per = []
    for _, h in cases:
        sites = sum(m["sites"] for m in h["modules"])
        per.append((h["file_allocated"] / sites, h["file_size"] / sites, sites))
    TARGETS.append(("runtime memory per site (counters file: counters, per site; the site table is shared)",
                    f"{per[0][0]:,.0f} bytes allocated ({per[0][1]:,.0f} reserved) holding {os.path.basename(f)} switched on; "
                    f"{per[1][0]:,.0f} bytes ({per[1][1]:,.0f} reserved) after the C++ workload", "(reported)", "", sec.title))

    # Per tracked live object: a program holding LIVE_OBJECTS allocations.
    exe = build("live_objects.c")
    pexe = patched(exe)[0]
    res = {}
    for v, prog in (("unpatched", exe), ("live", pexe)):
        clear_counters()
        p = subprocess.Popen([prog, str(LIVE_OBJECTS)], env=env_of(v), stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
        try:
            if p.stdout.readline().strip() != "ready":
                raise RuntimeError("live_objects did not start")
            with open(f"/proc/{p.pid}/status") as st:
                rss = int(re.search(r"VmRSS:\s+(\d+)", st.read()).group(1)) * 1024
            hdr = read_header(os.path.join(WORK, "counters", f"{p.pid}.counters")) if v == "live" else None
        finally:
            p.stdin.write("\n")
            p.stdin.close()
            p.wait()
        res[v] = (rss, hdr)
    hdr = res["live"][1]
    rss_delta = (res["live"][0] - res["unpatched"][0]) / LIVE_OBJECTS
    cmd = f"`ALLOCTRAMP=on $W/patched/live_objects {LIVE_OBJECTS}`"
    live = hdr["live"]
    value = (f"{rss_delta:.1f} bytes (RSS {res['live'][0] / 2**20:,.1f} MiB against {res['unpatched'][0] / 2**20:,.1f} MiB unpatched)"
             if live else "n/a (live tracking was off)")
    sec.para(f"**Per tracked live object**: `bench/live_objects.c` holds {LIVE_OBJECTS:,} allocations of 32 bytes, "
             f"patched and run with profiling on ({cmd}); the figure is the resident memory of the patched program "
             "minus the unpatched one's (VmRSS, both holding the objects), divided by the objects held. Live tracking "
             "records an object of this size in the shadow map (4 bytes per 32-byte granule of the heap, materialised "
             "only where the heap is); the pointer table (TABLE_BYTES, TABLE_OBJECTS in the counters file) holds only "
             "the objects the shadow map cannot (wide ones, other allocators).")
    sec.table(["figure", "value"], [
        ["RSS of the patched program (on) minus the unpatched one, per object", value],
        ["pointer table bytes (TABLE_BYTES)", f"{hdr['table_bytes']:,}"],
        ["objects in the pointer table (TABLE_OBJECTS)", f"{hdr['table_objects']:,}"],
    ])
    target(sec, "runtime memory per tracked live object", value, "<= 16 bytes", rss_delta <= 16 if live else None)


def build_and_patch(src, subdir, *flags, name=None):
    """bench/SRC built (with FLAGS, as NAME), and patched with no option into $W/SUBDIR: (unpatched, patched) paths."""
    loop = build(src, *flags, name=name)
    d = os.path.join(WORK, subdir)
    os.makedirs(d, exist_ok=True)
    ploop = os.path.join(d, os.path.basename(loop))
    subprocess.run([AT, "patch", loop, "-o", ploop], check=True, env=base_env(),
                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return loop, ploop


def pair_loop(sec, name, loop, ploop, n1, n2):
    """Callgrind instructions of a pair loop's `work` unpatched and patched (off, counting, live) at N1 and N2
    pairs; a table of them in SEC; returns the extra instructions per pair of each patched variant."""
    lp = {}
    for v in ("unpatched", "off", "count", "live"):
        for n in (n1, n2):
            log(f"callgrind: {name} {v}, {n} pairs")
            lp[v, n] = callgrind([ploop if v in PATCHED else loop, str(n)], env_of(v), toggle="work")
    base = (lp["unpatched", n2] - lp["unpatched", n1]) / (n2 - n1)
    per = {v: (lp[v, n2] - lp[v, n1]) / (n2 - n1) - base for v in PATCHED}
    rows = []
    for v, label, _ in VARIANTS:
        if v not in ("unpatched",) + PATCHED:
            continue
        e = env_shown(v)
        where = "$W/charged/" if v in PATCHED else "$W/"
        cmd = f"`{e + ' ' if e else ''}valgrind --tool=callgrind --toggle-collect=work {where}{name} N`"
        rows.append([label, cmd, f"{lp[v, n1]:,}", f"{lp[v, n2]:,}", f"{(lp[v, n2] - lp[v, n1]) / (n2 - n1):.2f}",
                     "" if v == "unpatched" else f"{per[v]:+.2f}"])
    sec.table(["variant", "command", f"loop, N={n1:,}", f"loop, N={n2:,}", "per pair", "extra per pair"], rows)
    return per


def part_wrappers():
    """A malloc+free pair through one level of allocation wrappers, charged to the wrappers' caller; and through
    a hook."""
    loop, ploop = build_and_patch("wrapper_loop.c", "charged")
    n1, n2 = CALLGRIND_PAIRS, 2 * CALLGRIND_PAIRS
    sec = Section(
        "Instructions through allocation wrappers", "wrappers",
        "`bench/wrapper_loop.c`: `xmalloc` (malloc, dies on NULL) and `xfree` (free), static functions of the "
        f"program, called in a loop; patched with `alloctramp patch` (which charges callers), so the loop's two calls are "
        "the sites that count and the calls inside the wrappers are not patched. Instructions of the loop "
        f"(`valgrind --tool=callgrind --toggle-collect=work`) at {n1:,} and {n2:,} pairs; the per-pair difference "
        "against the unpatched program.",
    )
    SECTIONS.append(sec)
    per = pair_loop(sec, "wrapper_loop", loop, ploop, n1, n2)
    target(sec, "through one wrapper level, off: extra instructions per pair", f"{per['off']:.2f}", "exactly 0",
           per["off"] == 0)
    target(sec, "through one wrapper level, counting: extra instructions per pair", f"{per['count']:.2f}", "<= 25",
           per["count"] <= 25)
    sec.para(f"Live bytes through the wrapper: {per['live']:+.2f} instructions per pair (no target of its own; the "
             "live target for a direct pair is 60).")

    # A hook: a wrapper whose size is a constant cannot be charged by size;
    # its call takes what the call inside counts.
    hloop, phloop = build_and_patch("hook_loop.c", "charged")
    sec.para("`bench/hook_loop.c`: `new_obj()` calls `xmalloc(sizeof (struct obj))`, a constant size, so its callers "
             "cannot be charged by size: the loop's call of `new_obj` is a hook, which takes what the `xmalloc` call "
             "inside counts (its trampoline records the thread's charge; the site inside checks it and counts into "
             "the hook's cell), and `free` is called directly. Same method.")
    hper = pair_loop(sec, "hook_loop", hloop, phloop, n1, n2)
    target(sec, "through a hook, off: extra instructions per pair", f"{hper['off']:.2f}", "exactly 0",
           hper["off"] == 0)
    target(sec, "through a hook, counting: extra instructions per pair", f"{hper['count']:.2f}", "<= 60",
           hper["count"] <= 60)
    sec.para("What a hook costs, counting: its trampoline records the thread's charge (cell, return address, stack "
             "pointer) and clears it after the call (about 19 instructions); the site inside checks the charge (3, "
             "and 4 more to confirm the hook's call is under way) and counts into the hook's cell; here GCC also "
             "made a constant-size clone of `xmalloc`, itself a hook inside the hook (about 10 to pass through).")


def part_callers():
    """Callers capture: instructions per captured call at depth 4, and nothing where it is off."""
    loop, ploop = build_and_patch("chain_loop.c", "callers")
    # The same loop with frame pointers: every frame's CFA comes from rbp,
    # so no call is recognised from its site's memo and each is unwound.
    fp, pfp = build_and_patch("chain_loop.c", "callers", "-fno-omit-frame-pointer", name="chain_loop_fp")
    n1, n2 = CALLGRIND_PAIRS, 2 * CALLGRIND_PAIRS
    sec = Section(
        "Callers capture", "callers",
        "`bench/chain_loop.c`: malloc and free at the bottom of a call chain five functions deep, N pairs. "
        "Profiling on and counting only (`ALLOCTRAMP=on ALLOCTRAMP_LIVE=0`), without and with "
        "`ALLOCTRAMP_CALLERS=4` (both sites record chains of 4 frames); instructions of the loop "
        f"(`valgrind --tool=callgrind --toggle-collect=work`) at {n1:,} and {n2:,} pairs. A captured call is one "
        "of the two calls of a pair. Built with `gcc -O2` (frames found from the stack pointer: after the first "
        "call, each is recognised from its site's last chain by reading one word per frame), and with "
        "`-fno-omit-frame-pointer` as `chain_loop_fp` (frames found through rbp: every call is unwound with the "
        "rows).",
    )
    SECTIONS.append(sec)
    runs = {}
    counting = {"ALLOCTRAMP": "on", "ALLOCTRAMP_LIVE": "0"}
    callers = dict(counting, ALLOCTRAMP_CALLERS="4")
    variants = [("unpatched", loop, {}), ("counting", ploop, counting),
                ("counting, callers at depth 4", ploop, callers),
                ("frame pointers: counting", pfp, counting),
                ("frame pointers: counting, callers at depth 4", pfp, callers)]
    for name, exe, extra in variants:
        env = base_env(extra)
        for n in (n1, n2):
            log(f"callgrind: {os.path.basename(exe)} {name}, {n} pairs")
            runs[name, n] = callgrind([exe, str(n)], env, toggle="work")
    per = {name: (runs[name, n2] - runs[name, n1]) / (n2 - n1) for name, _, _ in variants}
    rows = []
    for name, exe, extra in variants:
        shown = " ".join(f"{k}={v}" for k, v in extra.items())
        where = "$W/callers/" if exe in (ploop, pfp) else "$W/"
        cmd = (f"`{shown + ' ' if shown else ''}valgrind --tool=callgrind --toggle-collect=work "
               f"{where}{os.path.basename(exe)} N`")
        rows.append([name, cmd, f"{runs[name, n1]:,}", f"{runs[name, n2]:,}", f"{per[name]:.2f}"])
    sec.table(["variant", "command", f"loop, N={n1:,}", f"loop, N={n2:,}", "per pair"], rows)
    captured = (per["counting, callers at depth 4"] - per["counting"]) / 2
    target(sec, "callers capture at depth 4: extra instructions per captured call", f"{captured:.1f}", "<= 150",
           captured <= 150)
    unwound = (per["frame pointers: counting, callers at depth 4"] - per["frame pointers: counting"]) / 2
    sec.para(f"Every call unwound (frame pointers): {unwound:+.1f} instructions per captured call (no target of "
             "its own; it is what a call costs whose chain is not its site's last one).")
    sec.para("Where it is off (no `ALLOCTRAMP_CALLERS`), the sites jump to the entries they use without callers "
             "capture: the counting row is that cost.")


def part_fault():
    """Fault injection: what a spec costs the sites it names (when no call fails), and the others."""
    loop, ploop = build_and_patch("malloc_loop.c", "fault", "-pthread")
    n1, n2 = CALLGRIND_PAIRS, 2 * CALLGRIND_PAIRS
    sec = Section(
        "Fault injection", "fault",
        "`bench/malloc_loop.c` (malloc and free in `work`), N pairs, counting only (`ALLOCTRAMP=on "
        "ALLOCTRAMP_LIVE=0`), without a fault spec, with one that names no site of the program (`main:nth=1`: "
        "`main` allocates nothing itself), and with one that names the loop's malloc but fails none of its calls "
        "(`work:after=1000000000000`: every call is counted and decided); instructions of the loop "
        f"(`valgrind --tool=callgrind --toggle-collect=work`) at {n1:,} and {n2:,} pairs.",
    )
    SECTIONS.append(sec)
    counting = {"ALLOCTRAMP": "on", "ALLOCTRAMP_LIVE": "0"}
    variants = [("unpatched", loop, {}), ("counting", ploop, counting),
                ("counting, a spec naming no site", ploop, dict(counting, ALLOCTRAMP_FAIL="main:nth=1")),
                ("counting, a spec naming the malloc site", ploop,
                 dict(counting, ALLOCTRAMP_FAIL="work:after=1000000000000"))]
    runs = {}
    for name, exe, extra in variants:
        for n in (n1, n2):
            log(f"callgrind: fault {name}, {n} pairs")
            runs[name, n] = callgrind([exe, str(n), "1"], base_env(extra), toggle="work")
    per = {name: (runs[name, n2] - runs[name, n1]) / (n2 - n1) for name, _, _ in variants}
    rows = []
    for name, exe, extra in variants:
        shown = " ".join(f"{k}={v}" for k, v in extra.items())
        where = "$W/fault/" if exe == ploop else "$W/"
        cmd = f"`{shown + ' ' if shown else ''}valgrind --tool=callgrind --toggle-collect=work {where}malloc_loop N 1`"
        rows.append([name, cmd, f"{runs[name, n1]:,}", f"{runs[name, n2]:,}", f"{per[name]:.2f}"])
    sec.table(["variant", "command", f"loop, N={n1:,}", f"loop, N={n2:,}", "per pair"], rows)
    unnamed = per["counting, a spec naming no site"] - per["counting"]
    named = per["counting, a spec naming the malloc site"] - per["counting"]
    target(sec, "fault spec in effect: extra instructions per pair at sites it does not name", f"{unnamed:+.2f}",
           "0", abs(unnamed) < 0.5)
    target(sec, "fault spec: extra instructions per call of a site it names (no call failing)", f"{named:+.1f}",
           "<= 300", named <= 300)


TRACE_EVENTS = setting("BENCH_TRACE_EVENTS", 10_000_000, 2_000_000)


def part_trace():
    """Event traces: instructions per traced event on top of counting, and bytes per event on disk."""
    loop, ploop = build_and_patch("malloc_loop.c", "trace", "-pthread")
    # Below a ring's 16,384 records, so that no event is dropped without a
    # drainer (callgrind runs the program alone).
    n1, n2 = 1000, 3000
    sec = Section(
        "Event traces", "trace",
        "`bench/malloc_loop.c` (malloc and free in `work`), N pairs on one thread, profiling on from the start "
        "counting only (`ALLOCTRAMP_LIVE=0`), with live tracking (the default), and traced from the start "
        "(`ALLOCTRAMP_TRACE=on`: every allocation and free is recorded in the thread's ring of the trace file; "
        f"{n1:,} and {n2:,} pairs fit in a ring, so no event is dropped and none is drained); instructions of the "
        "loop (`valgrind --tool=callgrind --toggle-collect=work`). Then the same loop of "
        f"{TRACE_EVENTS // 2:,} pairs traced by `alloctramp run --trace DIR` (release build, the drainer beside "
        "the program): the trace's bytes on disk (every file of DIR) per event in it.",
    )
    SECTIONS.append(sec)
    variants = [("counting", {"ALLOCTRAMP": "on", "ALLOCTRAMP_LIVE": "0"}), ("live tracking", {"ALLOCTRAMP": "on"}),
                ("traced", {"ALLOCTRAMP_TRACE": "on"})]
    runs = {}
    for name, extra in variants:
        for n in (n1, n2):
            log(f"callgrind: trace {name}, {n} pairs")
            runs[name, n] = callgrind([ploop, str(n), "1"], base_env(extra), toggle="work")
    per = {name: (runs[name, n2] - runs[name, n1]) / (n2 - n1) for name, _ in variants}
    rows = []
    for name, extra in variants:
        shown = " ".join(f"{k}={v}" for k, v in extra.items())
        cmd = f"`{shown} valgrind --tool=callgrind --toggle-collect=work $W/trace/malloc_loop N 1`"
        rows.append([name, cmd, f"{runs[name, n1]:,}", f"{runs[name, n2]:,}", f"{per[name]:.2f}"])
    sec.table(["variant", "command", f"loop, N={n1:,}", f"loop, N={n2:,}", "per pair"], rows)
    extra = (per["traced"] - per["counting"]) / 2
    target(sec, "traced: extra instructions per event on top of counting", f"{extra:+.1f}", "<= 60", extra <= 60)

    out = os.path.join(WORK, "trace", "out")
    shutil.rmtree(out, ignore_errors=True)
    pairs = TRACE_EVENTS // 2
    cmd = [AT, "run", "-q", "--top", "0", "--cache", os.path.join(WORK, "trace", "cache"), "--trace", out, "--",
           loop, str(pairs), "1"]
    log(f"trace: {pairs} pairs")
    r = subprocess.run(cmd, env=base_env(), capture_output=True, text=True)
    if r.returncode != 0:
        raise RuntimeError(f"{show(cmd)}: {r.stderr[-600:]}")
    m = re.search(r": (\d+) events in .*?(no event lost|(\d+) events lost)", r.stderr)
    if not m:
        raise RuntimeError(f"{show(cmd)}: no summary in {r.stderr[-600:]}")
    events, lost = int(m.group(1)), int(m.group(3) or 0)
    size = sum(os.path.getsize(os.path.join(out, f)) for f in os.listdir(out))
    sec.table(["command", "events in the trace", "lost", "bytes on disk", "bytes per event"],
              [[f"`alloctramp run --trace DIR -- malloc_loop {pairs} 1`", f"{events:,}", f"{lost:,}", f"{size:,}",
                f"{size / max(events, 1):.2f}"]])
    target(sec, "trace: bytes on disk per event", f"{size / max(events, 1):.2f}", "<= 24", size / max(events, 1) <= 24)
    shutil.rmtree(out, ignore_errors=True)


PERL_SCRIPT = """my %h;
for my $i (1 .. 200000) { $h{"key$i"} = [$i, "v" x ($i % 50)]; }
my $n = 0;
for my $k (sort keys %h) { $n += length($h{$k}[1]); }
my @words = map { join("", reverse split //, $_) } keys %h;
print "$n ", scalar(@words), "\\n";
"""


def attribution_shares(exe, counters):
    """Bytes requested at the rows of the counters files in COUNTERS: (total, share outside EXE's allocation
    wrappers, share outside the wrappers whose size is their caller's, top rows)."""
    doc = json.loads(output([AT, "sites", "--json", exe], env=base_env()))
    listed = {w["function"] for w in doc["wrappers"]}
    passing = {w["function"] for w in doc["wrappers"] if w["countable"]}
    total, outside, outside_passing, rows = 0, 0, 0, {}
    for f in counters_files(counters):
        rep = json.loads(output([AT, "report", "--format", "json", f], env=base_env()))
        for r in rep["sites"]:
            if r["kind"] == "free":
                continue
            fn = (r.get("function") or "?").split("(")[0]
            total += r["bytes"]
            outside += 0 if fn in listed else r["bytes"]
            outside_passing += 0 if fn in passing else r["bytes"]
            rows[fn] = rows.get(fn, 0) + r["bytes"]
    top = sorted(rows.items(), key=lambda x: -x[1])[:3]
    return total, outside / max(total, 1), outside_passing / max(total, 1), top


def part_attribution():
    """Rows name the code that allocates: perl, git, redis-server and cc1plus (and a Rust program) patched with --no-charge-callers and with no option."""
    sec = Section(
        "Attribution: rows that name the code that allocates", "attribution",
        "Each program is patched twice, with `alloctramp patch --no-charge-callers` and with `alloctramp patch` (charging callers, the default), and "
        "run with profiling on from the start (`ALLOCTRAMP=on`). The figure is the share of the bytes requested "
        "(allocations and reallocs, every row of every counters file) that the report charges to rows whose function "
        "is not one of the program's allocation wrappers (as `alloctramp sites` lists them); beside it, the share "
        "outside the wrappers whose size is their caller's (the ones that can pass the charge on: a function that "
        "computes the size it allocates is where the allocation is decided). perl: `perl SCRIPT` on a hash-heavy "
        "script (200,000 keys, bench/bench.py PERL_SCRIPT, PERL_HASH_SEED=0). git: the git workload's 15 commands "
        "(section git) with GIT_EXEC_PATH at the patched copy. redis-server: on a loopback port, "
        "`redis-benchmark -n 20000 -t set,get,lpush,lpop,hset,sadd`, then `redis-cli shutdown nosave`. cc1plus (stripped): "
        "the section cc1plus's compilation (`cc1plus -O1` of a preprocessed template-heavy source).",
    )
    SECTIONS.append(sec)
    rows = []
    programs = [("perl", shutil.which("perl")), ("git", shutil.which("git")), ("redis-server", shutil.which("redis-server")),
                ("cc1plus", cc1plus_path())]
    for name, exe in programs:
        if not exe:
            target(sec, f"{name}: bytes charged outside allocation wrappers", "not installed",
                   ">= 90%", False)
            continue
        res = {}
        for variant, flags in (("before", ["--no-charge-callers"]), ("after", [])):
            d = os.path.join(WORK, f"attr-{variant}")
            os.makedirs(d, exist_ok=True)
            copy = os.path.join(d, os.path.basename(exe))
            subprocess.run([AT, "patch", *flags, exe, "-o", copy], check=True, env=base_env(), capture_output=True)
            counters = os.path.join(WORK, f"attr-counters-{name}-{variant}")
            os.makedirs(counters, mode=0o700, exist_ok=True)
            env = base_env({"ALLOCTRAMP": "on", "ALLOCTRAMP_DIR": counters})
            log(f"attribution: {name}, {variant}")
            if name == "perl":
                script = os.path.join(WORK, "hash.pl")
                with open(script, "w") as f:
                    f.write(PERL_SCRIPT)
                subprocess.run([copy, script], check=True, env={**env, "PERL_HASH_SEED": "0"}, capture_output=True)
            elif name == "cc1plus":
                w = Cc1plus()
                subprocess.run([copy, *w.args()], check=True, env=env, cwd=WORK, capture_output=True)
            elif name == "git":
                w = GitWorkload()
                w.prepare_run()
                genv = {**env, **w.env, "GIT_EXEC_PATH": d}
                for c in [["init", "-q", "-b", "main"]] + [x for k in range(w.PARTS) for x in (["add", f"p{k}"], ["commit", "-q", "-m", f"part {k}"])] + [["log", "--stat"], ["gc", "-q"], ["fsck", "--no-progress"], ["log", "--oneline"]]:
                    subprocess.run([copy, *c], check=True, env=genv, cwd=w.tree, capture_output=True)
            else:
                port = "7391"
                server = subprocess.Popen([copy, "--port", port, "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"],
                                          env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
                try:
                    for _ in range(100):
                        if subprocess.run(["redis-cli", "-p", port, "ping"], capture_output=True).stdout.strip() == b"PONG":
                            break
                        time.sleep(0.1)
                    subprocess.run(["redis-benchmark", "-p", port, "-n", "20000", "-q", "-t", "set,get,lpush,lpop,hset,sadd"],
                                   check=True, capture_output=True)
                    subprocess.run(["redis-cli", "-p", port, "shutdown", "nosave"], capture_output=True)
                    server.wait(timeout=30)
                finally:
                    if server.poll() is None:
                        server.kill()
            res[variant] = attribution_shares(exe, counters)
        (tb, sb, _, topb), (ta, sa, pa, topa) = res["before"], res["after"]
        shown = lambda top: "; ".join(f"`{fn}` {b:,}" for fn, b in top)
        rows.append([name, f"{tb:,}", f"{sb:.1%}", shown(topb), f"{ta:,}", f"{sa:.1%}", f"{pa:.1%}", shown(topa)])
        target(sec, f"{name}: bytes charged outside allocation wrappers", f"{sa:.1%}", ">= 90%",
               sa >= 0.9)
    sec.table(["program", "bytes (--no-charge-callers)", "outside wrappers", "top rows", "bytes (default)",
               "outside wrappers", "outside wrappers that pass the charge on", "top rows"], rows)
    rust_attribution(sec)
    sec.para("Bytes differ between the two runs where a wrapper asks the allocator for other than what its caller "
             "asked (perl's safesysmalloc turns 0 into 1; git's xmalloc retries malloc(0) as malloc(1)): with "
             "callers charged the bytes are the caller's request.")


# Names of the Rust standard library's allocation plumbing (the default
# plumbing list's Rust patterns, patcher/src/plumbing.rs).
RUST_PLUMBING = ("alloc::", "__rdl_", "__rust_", "__rustc::", "hashbrown::", "<alloc::", "core::ptr::drop_in_place")


def rust_attribution(sec):
    """testbins/rust/collections.rs (String, Vec, HashMap, format!): bytes charged outside allocation plumbing."""
    rustc = shutil.which("rustc")
    if not rustc:
        target(sec, "Rust program: bytes at rows outside allocation plumbing", "rustc not installed", ">= 90%", False)
        return
    exe = os.path.join(WORK, "collections")
    subprocess.run([rustc, "-O", "-g", "--edition", "2021", os.path.join(ROOT, "testbins", "rust", "collections.rs"),
                    "-o", exe], check=True, capture_output=True)
    res = {}
    for variant, flags in (("before", ["--no-charge-callers"]), ("after", [])):
        d = os.path.join(WORK, f"attr-{variant}")
        os.makedirs(d, exist_ok=True)
        copy = os.path.join(d, "collections")
        subprocess.run([AT, "patch", *flags, exe, "-o", copy], check=True, env=base_env(), capture_output=True)
        counters = os.path.join(WORK, f"attr-counters-rust-{variant}")
        shutil.rmtree(counters, ignore_errors=True)
        os.makedirs(counters, mode=0o700)
        log(f"attribution: rust, {variant}")
        env = base_env({"ALLOCTRAMP": "on", "ALLOCTRAMP_CALLERS": "8", "ALLOCTRAMP_DIR": counters})
        subprocess.run([copy], check=True, env=env, capture_output=True)
        total, in_rows, in_chains, rows = 0, 0, 0, {}
        for f in counters_files(counters):
            rep = json.loads(output([AT, "report", "--callers", "--format", "json", f], env=base_env()))
            for r in rep["sites"]:
                if r["kind"] == "free":
                    continue
                fn = r.get("function") or "?"
                total += r["bytes"]
                rows[fn] = rows.get(fn, 0) + r["bytes"]
                chains = r.get("callers") or []
                if any(c["outside_plumbing"] is not None for c in chains) or fn.startswith(RUST_PLUMBING):
                    # A row in plumbing: with --callers its bytes go to each
                    # chain's first frame outside it, when it has one.
                    in_chains += sum(c["bytes"] for c in chains if c["outside_plumbing"] is not None)
                else:
                    in_rows += r["bytes"]
                    in_chains += r["bytes"]
        top = sorted(rows.items(), key=lambda x: -x[1])[:3]
        res[variant] = (total, in_rows / max(total, 1), in_chains / max(total, 1), top)
    (tb, rb, cb, topb), (ta, ra, ca, topa) = res["before"], res["after"]
    shown = lambda top: "; ".join(f"`{fn}` {b:,}" for fn, b in top)
    sec.para("A Rust program, `testbins/rust/collections.rs` (String, Vec, HashMap, `format!`), built with `rustc -O -g` "
             "and run with `ALLOCTRAMP=on ALLOCTRAMP_CALLERS=8`: the share of bytes at rows outside the standard "
             "library's allocation plumbing (`alloc::`, `__rdl_`, `__rust_`, hashbrown), and the share that "
             "`report --callers` charges outside it (a row in plumbing passes its bytes to each chain's first frame "
             "outside it). Rows inside plumbing that was inlined are named after the first caller outside it; "
             "a call to plumbing that was not inlined (hashbrown's `reserve_rehash`, `RawVec`'s `finish_grow`, "
             "`format!`'s `format_inner`) is a hook, which charges what it allocates to the code that called it "
             "(trampolines carry unwind entries, so panics unwind through them as in the original).")
    sec.table(["program", "bytes (--no-charge-callers)", "rows outside plumbing", "with --callers", "top rows",
               "bytes (default)", "rows outside plumbing", "with --callers", "top rows"],
              [["rust collections", f"{tb:,}", f"{rb:.1%}", f"{cb:.1%}", shown(topb), f"{ta:,}", f"{ra:.1%}",
                f"{ca:.1%}", shown(topa)]])
    target(sec, "Rust program: bytes at rows outside allocation plumbing", f"{ra:.1%}", ">= 90%", ra >= 0.9)
    target(sec, "Rust program: bytes charged outside allocation plumbing with --callers", f"{ca:.1%}", ">= 90%",
           ca >= 0.9)


PARTS = {
    "attribution": part_attribution,
    "wrappers": part_wrappers,
    "callers": part_callers,
    "fault": part_fault,
    "trace": part_trace,
    "scan": part_scan,
    "patch": part_patch,
    "instructions": part_instructions,
    "loop": part_loop,
    "cxx": part_cxx,
    "cc1plus": part_cc1plus,
    "git": part_git,
    "switch": part_switch,
    "memory": part_memory,
    "lifetimes": part_lifetimes,
    "redis": part_redis,
}
ALL = ["instructions", "lifetimes", "wrappers", "callers", "fault", "trace", "loop", "cxx", "cc1plus", "git", "attribution", "scan", "patch", "switch",
       "memory"]
ALIASES = {"all": ALL, "runtime": ["instructions", "loop", "switch"]}


# ---------------------------------------------------------------------------
# The document.


def machine():
    cpu = "?"
    with open("/proc/cpuinfo") as f:
        m = re.search(r"^model name\s*:\s*(.*)$", f.read(), re.M)
        cpu = m.group(1) if m else cpu
    with open("/proc/meminfo") as f:
        mem = int(re.search(r"MemTotal:\s+(\d+)", f.read()).group(1)) * 1024
    osname = "?"
    if os.path.exists("/etc/os-release"):
        with open("/etc/os-release") as f:
            m = re.search(r'^PRETTY_NAME="?([^"\n]*)', f.read(), re.M)
            osname = m.group(1) if m else osname

    def ver(argv, pattern=r"(\d+\.\d+(\.\d+)?)"):
        try:
            r = subprocess.run(argv, capture_output=True, text=True)
            m = re.search(pattern, r.stdout + r.stderr)
            return m.group(1) if m else "?"
        except OSError:
            return "not found"

    commit = output(["git", "-C", ROOT, "rev-parse", "--short", "HEAD"]).strip()
    dirty = subprocess.run(["git", "-C", ROOT, "diff", "--quiet", "HEAD", "--", "cli", "patcher", "runtime", "trampolines"]).returncode != 0
    return [
        ["cores", f"{os.cpu_count()} (`nproc`)"],
        ["CPU", cpu + " (/proc/cpuinfo)"],
        ["memory", f"{mem / 2**30:.1f} GiB"],
        ["kernel", platform.release()],
        ["system", osname],
        ["alloctramp", f"commit {commit}" + (" with uncommitted changes to the sources" if dirty else "")],
        ["tools", f"gcc {ver(['gcc', '--version'])}, valgrind {ver(['valgrind', '--version'])}, heaptrack {ver(['heaptrack', '--version'])}, "
                  f"git {ver(['git', '--version'])}, binutils {ver(['objdump', '--version'])}"],
    ]


def document(parts, started, elapsed, load_start, load_end, mach):
    date = started.strftime("%Y-%m-%d %H:%M UTC")
    cmd = "bench/run" if parts == ALL else "bench/run " + " ".join(parts)
    out = ["# Benchmarks", ""]
    if QUICK:
        out += ["**Quick mode (BENCH_QUICK=1): small sizes, not the figures of record.**", ""]
    out += [
        f"Written by `{cmd}` on {date}; the run took {elapsed // 60:.0f} min {elapsed % 60:.0f} s. Every figure below "
        "comes from that one run: run the same command to reproduce it (`bench/run PART` runs one part and prints "
        "its tables; parts: " + ", ".join(f"`{p}`" for p in ALL) + "). Not part of the test suite.",
        "",
        "## Machine",
        "",
        "| | |",
        "|---|---|",
    ]
    out += [f"| {k} | {v} |" for k, v in mach]
    out += [f"| load average (1 min) | {load_start:.2f} at the start, {load_end:.2f} at the end |", ""]
    out += [
        "## Targets",
        "",
        "Each target of the project, with the figure measured in this run. A missed target says **MISSED**.",
        "",
        "| figure | value | target | | section |",
        "|---|---|---|---|---|",
    ]
    for fig, value, goal, status, where in TARGETS:
        out.append(f"| {fig} | {value} | {goal} | {status} | {where} |")
    out += [
        "",
        "## How the figures are taken",
        "",
        f"- Wall times are medians of {RUNS + MORE_RUNS} runs for the unpatched program and the patched variants "
        f"({RUNS} for heaptrack and DHAT). The variants of a workload run in turn (unpatched, off, counting, "
        "live, heaptrack, DHAT, then again; after the tools' runs, unpatched, off, counting and live again), so a "
        "change in the machine's load affects them alike; ratios are against the unpatched program in the same run.",
        "- Variants: **unpatched** is the original program; **patched, profiling off** is `alloctramp patch`'s "
        "output run as is; **on, counting** sets `ALLOCTRAMP=on ALLOCTRAMP_LIVE=0`; **on, live bytes** sets "
        "`ALLOCTRAMP=on` (live tracking is the default where the runtime has it); **heaptrack** is "
        "`heaptrack -o FILE PROGRAM` (recording and its interpretation, as a user runs it); **DHAT** is "
        f"`valgrind --tool=dhat`, skipped where one run takes longer than {DHAT_LIMIT:.0f} s.",
        f"- Sizes: BENCH_RUNS={RUNS} BENCH_MORE_RUNS={MORE_RUNS} BENCH_LOOP_PAIRS={LOOP_PAIRS} BENCH_LOOP8_PAIRS={LOOP8_PAIRS} "
        f"BENCH_CXX_ROUNDS={CXX_ROUNDS} BENCH_CC1_UNITS={CC1_UNITS} BENCH_GIT_FILES={GIT_FILES} "
        f"BENCH_CALLGRIND_PAIRS={CALLGRIND_PAIRS} BENCH_STARTUP_RUNS={STARTUP_RUNS} BENCH_LIVE_OBJECTS={LIVE_OBJECTS} "
        f"BENCH_DHAT_LIMIT={DHAT_LIMIT:.0f} (environment variables of `bench/run`; BENCH_QUICK=1 makes them small).",
        "- `$W` is the run's scratch directory (on tmpfs when /dev/shm exists); `ALLOCTRAMP_DIR` is `$W/counters` "
        "for every run.",
        "- Every workload's output is compared across variants (checksum, assembly file, commit ids and log).",
    ]
    if LIVE_CHECKED:
        out.append("- " + LIVE_CHECKED[0])
    out.append("")
    for s in SECTIONS:
        out.append(s.markdown())
    return "\n".join(out).rstrip() + "\n"


def main(argv):
    global WORK
    parts = []
    for a in argv or ["all"]:
        if a in ALIASES:
            parts += ALIASES[a]
        elif a in PARTS:
            parts.append(a)
        else:
            print(f"unknown part {a!r}: {', '.join(list(PARTS) + list(ALIASES))}", file=sys.stderr)
            return 2
    writes_doc = parts == ALL
    base = "/dev/shm" if os.access("/dev/shm", os.W_OK) else None
    WORK = tempfile.mkdtemp(prefix="alloctramp-bench-", dir=base)
    started = datetime.datetime.now(datetime.timezone.utc)
    t0 = time.monotonic()
    load_start = os.getloadavg()[0]
    failed = []
    try:
        for part in parts:
            log(f"== {part}")
            before = len(SECTIONS)
            try:
                PARTS[part]()
            except Exception as e:  # one part failing does not lose the others' figures
                traceback.print_exc()
                if len(SECTIONS) == before:
                    SECTIONS.append(Section(part, part))
                SECTIONS[-1].para(f"**FAILED**: {e}")
                TARGETS.append((f"part `{part}` ran to the end", "failed: " + str(e).splitlines()[0][:200], "no failure", "**MISSED**", SECTIONS[-1].title))
                failed.append(part)
            for s in SECTIONS[before:]:
                print(s.markdown(), flush=True)
    finally:
        shutil.rmtree(WORK, ignore_errors=True)
    elapsed = time.monotonic() - t0
    print("| figure | value | target | | section |\n|---|---|---|---|---|")
    for fig, value, goal, status, where in TARGETS:
        print(f"| {fig} | {value} | {goal} | {status} | {where} |")
    log(f"done in {elapsed // 60:.0f} min {elapsed % 60:.0f} s")
    if writes_doc:
        path = os.environ.get("BENCH_DOC") or (os.path.join(ROOT, "docs", "benchmarks.md") if not QUICK else "/tmp/alloctramp-benchmarks-quick.md")
        with open(path, "w") as f:
            f.write(document(parts, started, elapsed, load_start, os.getloadavg()[0], machine()))
        log(f"wrote {path}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
