#!/usr/bin/env bash
# Install Grafana's TraceQL grammar (@grafana/lezer-traceql, the parser Grafana's editor uses)
# from npm into a cache directory, once, so tests can parse the documentation's TraceQL queries.
#
#   scripts/traceql-grammar.sh
#
# Environment:
#   OTELPROF_CACHE_DIR  cache directory (default: ${XDG_CACHE_HOME:-~/.cache}/otelprof)
#
# Prints the directory holding node_modules/ as its last line on stdout.
# tests/test_tempo.py computes the same path (traceql_dir) — keep the two in step.
set -euo pipefail

GRAMMAR_VERSION=1.0.0      # @grafana/lezer-traceql
LEZER_LR_VERSION=1.4.2     # its peer dependency @lezer/lr

cache_dir="${OTELPROF_CACHE_DIR:-${XDG_CACHE_HOME:-$HOME/.cache}/otelprof}"
dir="$cache_dir/traceql-$GRAMMAR_VERSION"
if [[ ! -f "$dir/node_modules/@grafana/lezer-traceql/package.json" ]]; then
    for tool in node npm; do
        if ! command -v "$tool" >/dev/null 2>&1; then
            echo "traceql-grammar: '$tool' not found; install Node.js and npm to check TraceQL" >&2
            exit 2
        fi
    done
    mkdir -p "$dir"
    echo "traceql-grammar: installing @grafana/lezer-traceql@$GRAMMAR_VERSION into $dir" >&2
    npm install --prefix "$dir" --no-audit --no-fund --loglevel=error \
        "@grafana/lezer-traceql@$GRAMMAR_VERSION" "@lezer/lr@$LEZER_LR_VERSION" >&2
fi
echo "$dir"
