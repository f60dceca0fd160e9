#!/usr/bin/env bash
# Install the lowest version of every direct dependency that pyproject.toml allows (each `>=` bound becomes
# `==`, for the base install and every extra), then run the unit tests on them. This keeps the declared lower
# bounds honest. Called by `make test-lowest`; its virtualenv is .venv-lowest.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON=${PYTHON:-python3}
VENV=.venv-lowest
rm -rf "$VENV"
"$PYTHON" -m venv "$VENV"
"$VENV/bin/pip" install --quiet --upgrade pip
"$VENV/bin/python" - > "$VENV/lowest.txt" <<'PY'
import re, tomllib
project = tomllib.load(open("pyproject.toml", "rb"))["project"]
requirements = list(project["dependencies"])
# `generate` and `reference` need a later transformers than `serve` allows (continuous batching; sentence-transformers
# 6): the serve floor is what this run keeps honest, so those extras are left out here (their tests skip without
# them).
for name, extra in project["optional-dependencies"].items():
    if name not in ("generate", "reference"):
        requirements += [r for r in extra if not r.startswith("kinference")]
pins = {}
for requirement in requirements:
    match = re.fullmatch(r"([A-Za-z0-9_.-]+)(?:\[[^\]]*\])?>=([^,;\s]+)", requirement.strip())
    if match is None:
        raise SystemExit(f"pyproject.toml: {requirement!r} has no plain lower bound (name>=version)")
    name = match.group(1).lower().replace("_", "-")
    pins[name] = max(pins.get(name, match.group(2)), match.group(2), key=lambda v: tuple(map(int, re.findall(r"\d+", v))))
print("\n".join(f"{name}=={version}" for name, version in sorted(pins.items())))
PY
echo "lowest versions:"; sed 's/^/  /' "$VENV/lowest.txt"
# torch first, from the same source as `make install`; then everything else at its lower bound.
"$VENV/bin/pip" install --quiet ${TORCH_SOURCE:-} -c "$VENV/lowest.txt" torch
# dev's extras but generate and reference, and dev's own tools.
DEV_EXTRAS=$("$VENV/bin/python" -c 'import re, tomllib; dev = tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"]; own = next(r for r in dev if r.startswith("kinference[")); print(",".join(e for e in re.search(r"\[(.*)\]", own).group(1).split(",") if e not in ("generate", "reference")))')
DEV_TOOLS=$("$VENV/bin/python" -c 'import tomllib; print("\n".join(r for r in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["dev"] if not r.startswith("kinference")))')
mapfile -t tools <<< "$DEV_TOOLS"
"$VENV/bin/pip" install --quiet -c "$VENV/lowest.txt" -e ".[$DEV_EXTRAS]" "${tools[@]}"
"$VENV/bin/pip" freeze | grep -iE "^($(cut -d= -f1 "$VENV/lowest.txt" | paste -sd'|'))==" | sed 's/^/installed: /'
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -m "not integration and not faults" tests/unit
