# Convenience targets; scripts/ holds the real commands.
.PHONY: test demo lint chaos chaos-short bench bench-p1 bench-p1-floor bench-p1-processes bench-p2 bench-p2-ceiling bench-p3 bench-p4 bench-p5 bench-lag

test:
	./scripts/test

demo:
	./scripts/demo

chaos:
	./scripts/chaos

chaos-short:
	EXPLICIT_CHAOS=short ./scripts/chaos

lint:
	.venv/bin/ruff check . && .venv/bin/ruff format --check celery_explicit django_outbox tests bench example_project && .venv/bin/mypy && .venv/bin/lint-imports

bench: bench-p1 bench-p2 bench-p3 bench-p4 bench-p5 bench-lag

bench-p1:
	./scripts/bench throughput.py

bench-p1-floor:
	./scripts/bench throughput.py --floor

bench-p1-processes:
	./scripts/bench throughput.py --floor --by-process --tasks 1000 --rounds 4

bench-p2:
	./scripts/bench effect_cost.py

bench-p2-ceiling:
	./scripts/bench effect_ceiling.py

bench-p4:
	./scripts/bench lock_round_trips.py

bench-p5:
	./scripts/bench cache_hit.py

bench-p3:
	./scripts/bench relay_throughput.py

bench-lag:
	./scripts/bench outbox_lag.py
