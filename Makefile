# Both targets create/refresh .venv first (scripts/setup-venv is idempotent).
.PHONY: venv demo verify test

venv:
	@scripts/setup-venv

# The main job: P, D and the router as processes, two-stage requests over gRPC, each
# checked against the colocated reference.
demo: venv
	@mkdir -p out
	.venv/bin/kvhandoff demo --json out/demo.json

# The handoff-correctness harness (in-process engines, every edge case).
verify: venv
	@mkdir -p out
	.venv/bin/kvhandoff verify --json out/verify.json

test: venv
	.venv/bin/python -m pytest
