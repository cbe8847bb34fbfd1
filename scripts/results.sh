#!/usr/bin/env bash
# Regenerates docs/RESULTS.md: builds release once, runs each section's command in order and
# writes every section's fixed introduction (kept below), its command and that command's
# output verbatim. No figure on the page is typed by hand; the history of how the figures
# came about is docs/EXPERIMENTS.md, kept by hand.
#
#   scripts/results.sh                 every section (about half an hour on a 2-core machine)
#   scripts/results.sh --only NAME     one section; the page keeps the others as they were
#   scripts/results.sh --resume        every section, reusing those a run of this same clean
#                                      commit finished before it stopped (target/results/)
#   scripts/results.sh --list          the sections' names, in order
#
# The sections `model` and `parquet` run `cohabit-train`, which links libtorch: LIBTORCH as
# scripts/setup-libtorch.sh prints it (set here from that script when unset). They come
# last, and cohabit-train is built just before the first of them.
# A command that fails stops the run and leaves docs/RESULTS.md as it was: the page is
# written to a temporary file and renamed over it only once every section has run.
# Each section's wall time goes to stderr. Needs jq (the model section reads the artifacts).
set -euo pipefail
cd "$(dirname "$0")/.."
root="$PWD"
page=docs/RESULTS.md

sections=(bench foreign seeds overload posterior decision_time safe_explore tradeoff clite_vs_ml
    be_gap crowd_gap noise_gap model parquet)

# --- each section: its heading, its introduction and its commands (one a line) ---------

bench_title="Simulated results"
bench_intro="Every built-in scenario under every policy on its own platform, then the CPU
scenarios again on the Xeon Gold 6338 with that platform's warm-started model, then \`ml\`'s
targets checked side by side. Each scenario has one seed shared by every policy, so the
policies meet the same loads and the same measurement noise. Columns: \`qos_met\` is the
share of intervals with every latency-critical target met (on the simulator's truth);
\`sev_*\` how far over a target a miss was; \`conv_*\` the ticks to get back under a
target after a change; \`be_tput\` the best-effort jobs' throughput and \`be_vs_oracle\` the
same over the oracle's, which plans every interval on the truth with the future's loads
known, so it is a reference, not a policy; \`actuations\` the allocation changes written;
\`dec_*_us\` the decision time (the line under the header says how it is timed: it depends
on the machine and its load); \`be_mba\` and \`mba<100\` the pool's memory-bandwidth limit.
The checks at the end are the targets \`ml\` is held to, \"NO\" where one is missed."
bench_cmds=('cohabit bench')

foreign_title="Foreign hosts (issue 45)"
foreign_intro="\`ml\` on hosts and services its training data never drew: the scenarios in
\`lab/scenarios/foreign/\` each have a parameter outside what \`cohabit-train gen\` draws
(\`cohabit_training::drawn\`, checked by \`training/tests/foreign.rs\`). It shows how far the
shipped models carry: the median error of \`ml\`'s prediction for the plan it chose against
the p99 then measured (over all decisions, and over those that changed an allocation,
which are the ones that test the model), the share of decisions on the model's path, QoS
against the oracle's, and best effort against the oracle's. \`11-\` pools minutes 11 on,
the second half, where issue 45 sets its targets (the last lines of each scenario)."
foreign_cmds=('target/release/examples/foreign')

seeds_title="Runs meeting QoS over more seeds (issue 45)"
seeds_intro="Issue 45 counts runs that meet QoS in at least 99 % of intervals: on the built-in
CPU scenarios over ten seeds, and on the foreign hosts over each run. Such a count moves by
a few runs with any change, and ten or three seeds cannot tell that from the seeds' own
spread: here \`ml\` as built runs forty seeds on the built-ins (400 runs) and twenty on each
foreign host, and every run under 0.99 is named. A run that stays over a target for most
of its length (QoS far under 0.99) is a service the degrade rule left where it was."
seeds_cmds=('TRADEOFF_SETTINGS=1 TRADEOFF_SEEDS=40 TRADEOFF_MISSES=1 target/release/examples/tradeoff' 'FOREIGN_SEEDS=20 target/release/examples/foreign | grep -E "^(issue 45|SIMULATION|foreign-)"')

overload_title="GPU overload and the oracle as a bound (issue 49)"
overload_intro="Hosts with more latency-critical demand than capacity, where some target
must be missed: the crowded CPU scenarios and the GPU ones, each with its own seed, under
\`static\`, \`parties\`, \`ml\` and the oracle. On such a host the oracle is meant to be a
bound on its own ranking: it meets at least as many targets as any policy at every
priority level, and only then maximises best effort. Read \`met/n\` in the per-service
lines first (latency-critical services meeting their target per interval, averaged over
the run): the oracle's less \`ml\`'s is what \`ml\`'s overload order and search leave.
The oracle's search times (its own table, and its \`dec_*_us\`) depend on the machine and
its load."
overload_cmds=('for s in crowded-gold crowded-e5 gpu-llm-crowd gpu-inference lab/scenarios/gpu-llm-overload.toml lab/scenarios/crowded-gold-diurnal.toml; do cohabit compare --scenario "$s" --policies static,parties,ml,oracle; done')

model_title="The learned model"
model_intro="The shipped QoS-impact models (\`models/default/qos-v1.json\`, and
\`models/xeon-gold-6338/qos-v1-gold.json\` warm-started from it), a 5-member MLP ensemble over
24 features a real host can measure (docs/DESIGN.md). First the figures each artifact
recorded when it was fitted (\`metrics\` in its JSON: median |error| of ln(p99/target) in
distribution and on services held out of training, the ridge baseline's, the share of
truths inside ±2 predicted spreads, and the error and coverage of predicted *changes*,
which is what \`ml\` uses); then each model scored on datasets drawn fresh from the
simulator with seeds the training did not use (\`cohabit-train eval\`), so the recorded
figures are checked rather than trusted. Refitting the models is not part of this page
(docs/EXPERIMENTS.md, \"The learned model\", has the commands)."
model_cmds=(
    "jq .metrics models/default/qos-v1.json"
    "jq .metrics models/xeon-gold-6338/qos-v1-gold.json"
    'cohabit-train gen --scenes 3000 --seed 11 --out "$WORK/fresh.jsonl" >/dev/null'
    'cohabit-train eval --model models/default/qos-v1.json --data "$WORK/fresh.jsonl"'
    'cohabit-train gen --platform xeon-gold-6338 --scenes 400 --seed 3 --out "$WORK/gold.jsonl" >/dev/null'
    'cohabit-train eval --model models/xeon-gold-6338/qos-v1-gold.json --data "$WORK/gold.jsonl"'
    'cohabit-train eval --model models/default/qos-v1.json --data "$WORK/gold.jsonl"'
)

posterior_title="Per-host posterior (issue 45)"
posterior_intro="\`ml\` keeps, per latency-critical service, a Bayesian linear regression of
its anchored prediction's error on the ensemble's last hidden layer
(\`policy/src/ml/posterior.rs\`, \`models/src/posterior.rs\`; \`MlConfig::posterior\`). Its
prior is the shipped output layer with the members' raw disagreement as its spread; the
rest of the calibrated spread is noise no reading removes. \`builtin\` compares \`ml\`
before (the ensemble's spread, a bias and a spread factor per service) and with the
posterior on every built-in CPU scenario, E5 and Gold, ten seeds: runs meeting QoS in at
least 99 % of intervals, mean QoS, best effort against the oracle's. \`foreign\` follows
two hosts no model was trained for minute by minute: the share of decisions on the
model's path and the prediction's error should improve as the posterior learns."
posterior_cmds=('target/release/examples/posterior builtin' 'target/release/examples/posterior foreign')

decision_time_title="Decision time (eight services, with and without the posterior)"
decision_time_intro="How long one \`ml\` decision takes for eight latency-critical services
and a streaming job on the E5 and the Gold, at their loads and crowded, with and without
the per-host posterior (issue 45's target: a p99 under 1 ms). \`p50\` and \`p99\` are timed as
\`cohabit bench\` times \`ml\`: every decision of the run made again on the observation it
saw, on copies of the policy as it stood and over replays of the run, the least of those
timings its time, so that a preemption or a slow spell of a shared machine is not counted
as the policy's cost. \`run_p50\` and \`run_p99\` are the same decisions as timed in the run,
noise included. Every figure here is a timing: it depends on the machine and on what else
it runs, so compare the rows of one run, not runs of different machines."
decision_time_cmds=('target/release/examples/posterior timing')

safe_explore_title="Safe exploration (issue 45, item 3)"
safe_explore_intro="\`--explore\` around \`ml\` takes the informative safe step
(\`policy/src/explore/informative.rs\`, the default rule): among one core fewer, one way
fewer or the pool's ways shared, for one CPU service, the steps whose upper confidence
bound of ln(p99/target) from \`ml\`'s forecast with its posterior stays under the margin,
scored by best-effort gain times the share of the posterior's variance the step's reading
removes (SafeOpt's expanders). It is compared with \`ml\` alone and with the old random
walk on a 2-core host shaped like the project's VM, the \`demo\` on the E5 and two foreign
hosts. Exploration is worth keeping where it raises best effort without intervals over a
target under an explored plan (the last column)."
safe_explore_cmds=('target/release/examples/safe_explore')

tradeoff_title="ml's tunables: QoS against best effort"
tradeoff_intro="Each of \`ml\`'s tunables (docs/CONFIGURATION.md, \"Tuning ml\") moves it
along one trade: less caution leaves more to best effort and meets the targets in fewer
intervals. Each setting runs on every built-in CPU scenario, E5 and Gold, ten seeds; per
setting the runs meeting QoS in at least 99 % of intervals, mean QoS, mean best effort
against the oracle's, the worst scenario's, the scenarios reaching 0.95 of it and the
actuations. The last two settings give \`ml\` exact readings: its ceiling."
tradeoff_cmds=('target/release/examples/tradeoff')

clite_vs_ml_title="CLITE against ml"
clite_vs_ml_intro="\`clite\` (\`cohabit_policy::ClitePolicy\`) is this project's implementation
of CLITE's idea (HPCA'20: Bayesian optimisation over the whole host's allocation), the
published baseline \`ml\` is measured against. Every built-in CPU scenario on the E5 and
the Gold, three seeds, in two worlds: as built (loads step, swing and spike) and *steady*
(every load held at its mean, as CLITE's paper evaluates; a search then runs once)."
clite_vs_ml_cmds=('target/release/examples/clite_vs_ml')

be_gap_title="Where ml's best-effort gap comes from"
be_gap_intro="\`ml\` against three oracles on every built-in CPU scenario, E5 and Gold:
the default one (0.97 of each target on the truth, every way-range layout), one aiming at
\`ml\`'s margin, and one without shared way ranges; and \`ml\` with exact readings (its
ceiling). Where \`ml\` reaches the margin oracle but not the default one, the gap is the
safety margin a controller that measures needs; where it reaches neither, its search is
short too. Each run's mean allocation follows its line."
be_gap_cmds=('target/release/examples/be_gap')

crowd_gap_title="Where ml's gap on the crowded hosts comes from (issue 49)"
crowd_gap_intro="The crowded CPU scenarios and the foreign 20-core, 16-way host, each with its
own seed, under the oracle, the oracle without shared way ranges, \`ml\` and \`ml\` with exact
readings: latency-critical services meeting their targets per interval (\`met/n\`), best
effort against the oracle's, and the share of ticks at which \`ml\`'s needs did not fit the
host (the degrade rule decided). If the oracle without sharing meets as many targets as
the full one, shared ranges are not what \`ml\` lacks; if \`ml\` with exact readings is no
closer, neither are noise and caution. Then, per service, the share of intervals met and
the mean allocation under each, and for the services \`ml\` leaves over their targets, the
paths and reasons of its decisions in those intervals."
crowd_gap_cmds=('target/release/examples/crowd_gap')

noise_gap_title="Measurement noise against the model's spread"
noise_gap_intro="\`ml\` over ten seeds of every built-in CPU scenario, E5 and Gold, in seven
worlds that take away, one at a time and together, the latency window, half or all of
the model's calibrated spread, the measured p99's noise and the counters' noise: how much
of the best-effort gap to the oracle is measurement noise and how much the model's
spread. The last world (both quiet, no spread) is \`ml\`'s ceiling."
noise_gap_cmds=('target/release/examples/noise_gap')

parquet_title="Decision logs as Parquet"
parquet_intro="Three simulated hosts' decision logs exported to one Parquet file
(docs/FLEETS.md) and turned into training rows both from the JSON lines and from the
Parquet file: the two datasets must be identical (\`cmp\` prints nothing and the section
fails otherwise). The sizes show what the columnar file saves."
parquet_cmds=(
    'for s in demo:parties mba-stream:ml gpu-inference:parties; do cohabit simulate --scenario ${s%%:*} --policy ${s##*:} --out "$WORK/fleet-logs/${s%%:*}" >/dev/null; done'
    'cohabit-train export "$WORK/fleet-logs" --parquet "$WORK/logs.parquet"'
    'cohabit-train logs "$WORK/fleet-logs" --out "$WORK/rows-jsonl.jsonl"'
    'cohabit-train logs "$WORK/logs.parquet" --out "$WORK/rows-parquet.jsonl"'
    'cmp "$WORK/rows-jsonl.jsonl" "$WORK/rows-parquet.jsonl"'
    'du -b "$WORK"/fleet-logs/*/decisions.jsonl "$WORK/logs.parquet" | sed "s|$WORK/||"'
)

# --- the run ---------------------------------------------------------------------------

die() {
    echo "results.sh: $*" >&2
    exit 1
}

only=""
resume=0
case "${1:-}" in
"") ;;
--resume) resume=1 ;;
--only)
    only="${2:-}"
    [ -n "$only" ] || die "--only needs a section name (--list names them)"
    ;;
--list)
    printf '%s\n' "${sections[@]}"
    exit 0
    ;;
*) die "unknown argument '$1' (usage: scripts/results.sh [--only NAME | --resume | --list])" ;;
esac
if [ -n "$only" ]; then
    [[ " ${sections[*]} " == *" $only "* ]] || die "no section '$only' (--list names them)"
    [ -f "$page" ] || die "--only needs an existing $page"
    grep -q "^<!-- begin $only -->\$" "$page" || die "$page has no section '$only' to replace"
    run=("$only")
else
    run=("${sections[@]}")
fi

head="$(git rev-parse --short=12 HEAD)"
commit="$head"
clean=1
git diff --quiet HEAD -- . ':!docs/RESULTS.md' || clean=0
[ "$clean" = 1 ] || commit="$commit (with uncommitted changes)"
date="$(date -u '+%Y-%m-%d %H:%M UTC')"
cpus="$(nproc)"

start=$SECONDS
echo "results.sh: building release (cohabit and the lab examples)" >&2
cargo build --release --locked -p cohabit-controller --bin cohabit -p cohabit-lab --examples
echo "results.sh: build $((SECONDS - start)) s" >&2
export PATH="$root/target/release:$PATH"

train_built=0
build_train() {
    [ "$train_built" = 0 ] || return 0
    local t0=$SECONDS
    LIBTORCH="${LIBTORCH:-$(./scripts/setup-libtorch.sh)}"
    export LIBTORCH
    export LD_LIBRARY_PATH="$LIBTORCH/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}"
    cargo build --release --locked -p cohabit-training --bin cohabit-train
    train_built=1
    echo "results.sh: cohabit-train build $((SECONDS - t0)) s" >&2
}

# Each finished section is kept here, named by commit, for --resume.
done_dir="$root/target/results"
mkdir -p "$done_dir"
[ "$resume" = 1 ] || [ -n "$only" ] || rm -f "$done_dir"/*.md

WORK="$(mktemp -d -t cohabit-results.XXXXXX)"
export WORK
trap 'rm -rf "$WORK"' EXIT

# One section into $WORK/NAME.md, between markers that --only finds again.
section() {
    local name="$1" t0=$SECONDS title intro cmd out kept
    kept="$done_dir/$head-$name.md"
    if [ "$resume" = 1 ] && [ "$clean" = 1 ] && [ -f "$kept" ]; then
        cp "$kept" "$WORK/$name.md"
        echo "results.sh: section $name: kept from an earlier run of this commit" >&2
        return
    fi
    [[ "$name" != model && "$name" != parquet ]] || build_train
    title="${name}_title"
    intro="${name}_intro"
    local -n cmds="${name}_cmds"
    {
        echo "<!-- begin $name -->"
        echo "## ${!title}"
        echo
        echo "${!intro}"
        echo
    } >"$WORK/$name.md"
    for cmd in "${cmds[@]}"; do
        echo "results.sh: [$name] $cmd" >&2
        out="$WORK/$name.out"
        bash -euo pipefail -c "$cmd" >"$out" ||
            die "section '$name': command failed (exit $?): $cmd"
        # The scratch directory's name changes every run; the page says `$WORK`.
        sed -i "s|$WORK|\$WORK|g" "$out"
        {
            echo '```sh'
            echo "$cmd"
            echo '```'
            echo
            if [ -s "$out" ]; then
                echo '```'
                cat "$out"
                echo '```'
                echo
            fi
        } >>"$WORK/$name.md"
    done
    local wall=$((SECONDS - t0))
    {
        echo "(Commit $commit, $date, $cpus CPUs; this section took ${wall} s of wall time.)"
        echo "<!-- end $name -->"
    } >>"$WORK/$name.md"
    [ "$clean" = 0 ] || { cp "$WORK/$name.md" "$kept.tmp" && mv "$kept.tmp" "$kept"; }
    echo "results.sh: section $name: ${wall} s" >&2
}

for s in "${run[@]}"; do
    section "$s"
done

tmp="$page.tmp.$$"
if [ -n "$only" ]; then
    # The page as it was, with this section's block replaced.
    awk -v name="$only" -v file="$WORK/$only.md" '
        $0 == "<!-- begin " name " -->" { while ((getline line < file) > 0) print line; skip = 1; next }
        skip && $0 == "<!-- end " name " -->" { skip = 0; next }
        !skip { print }
    ' "$page" >"$tmp"
else
    {
        cat <<EOF
# Results

<!-- Generated by scripts/results.sh: do not edit by hand. -->

**SIMULATION:** every figure on this page comes from cohabit's simulated host
(docs/DESIGN.md, section 4), not from hardware, unless a section says otherwise. How these
figures came about, and the figures measured on real hosts, are in docs/EXPERIMENTS.md.

Generated by \`scripts/results.sh\` (every section) at commit $commit, $date, on a
machine with $cpus CPUs, after \`cargo build --release\` of \`cohabit\`, the lab examples
and \`cohabit-train\`; \`cohabit\` and \`cohabit-train\` below are those release binaries.
\`scripts/results.sh --only NAME\` regenerates one section and keeps the others; each
section gives the commit and date it was made at. The simulated figures are
deterministic per seed, except the timing columns (decision and search times): those
depend on the machine and on its load while the page was made.

Sections: $(for s in "${sections[@]}"; do t="${s}_title"; printf '%s' "${!t}; "; done | sed 's/; $/./')

EOF
        for s in "${sections[@]}"; do
            cat "$WORK/$s.md"
            echo
        done
    } >"$tmp"
fi
mv "$tmp" "$page"
echo "results.sh: wrote $page in $((SECONDS - start)) s" >&2
