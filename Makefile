# The two commands of the README. Each creates .venv by itself if missing.
.PHONY: run test lint

run:
	@scripts/bootstrap.sh
	.venv/bin/mixrl train

test:
	@scripts/bootstrap.sh --dev
	.venv/bin/ruff check src/mixrl/corrections src/mixrl/numerics src/mixrl/records src/mixrl/system src/mixrl/telemetry src/mixrl/lab/study
	.venv/bin/mypy src/mixrl/corrections src/mixrl/numerics src/mixrl/records src/mixrl/system src/mixrl/weights/refs.py src/mixrl/weights/store.py src/mixrl/fleet/handles.py
	NO_MKDOCS_2_WARNING=1 .venv/bin/mkdocs build --strict   # the documentation site (scripts/gen_docs.py)
	.venv/bin/python -m pytest

lint:
	.venv/bin/ruff check src tests
