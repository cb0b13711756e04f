# Both targets create/refresh .venv first (scripts/setup-venv is idempotent).
.PHONY: venv demo verify test

venv:
	@scripts/setup-venv

# The main job: the handoff-correctness harness on the built-in model.
demo: venv
	@mkdir -p out
	.venv/bin/kvhandoff verify --json out/verify.json

verify: demo

test: venv
	.venv/bin/python -m pytest
