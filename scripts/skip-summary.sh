#!/usr/bin/env bash
# Prints how many tests skipped and why, from the skip log the tests' gate wrote
# (cohabit-testkit: one line per skip, `need<TAB>test<TAB>why`).
set -euo pipefail
log="${1:?usage: skip-summary.sh SKIP_LOG}"
n=0
[ -s "$log" ] && n=$(wc -l <"$log")
echo "skipped tests: $n"
[ "$n" -eq 0 ] && exit 0
# By need, then each test with its reason.
cut -f1 "$log" | sort | uniq -c | sed 's/^ */  /'
sort "$log" | awk -F'\t' '{ printf "  [%s] %s: %s\n", $1, $2, $3 }'
