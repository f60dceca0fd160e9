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
for extra in project["optional-dependencies"].values():
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
"$VENV/bin/pip" install --quiet -c "$VENV/lowest.txt" -e ".[dev]"
"$VENV/bin/pip" freeze | grep -iE "^($(cut -d= -f1 "$VENV/lowest.txt" | paste -sd'|'))==" | sed 's/^/installed: /'
HF_HUB_OFFLINE=1 "$VENV/bin/python" -m pytest -q -m "not integration and not faults" tests/unit
