# Shared by scripts/test and scripts/demo. Sourced, not run.
set -euo pipefail

ROOT="$(cd "$(dirname "${BASH_SOURCE[0]}")/.." && pwd)"
VENV="${VENV:-$ROOT/.venv}"
PY="$VENV/bin/python"

ensure_venv() {
    # A fresh machine has no virtualenv: make one and install the package with its
    # test and dev extras (ruff, mypy, stubs). Re-run installs only what changed.
    if [ ! -x "$PY" ]; then
        python3 -m venv "$VENV"
        "$PY" -m pip install --quiet --upgrade pip
    fi
    local stamp="$VENV/.installed-$(sha1sum "$ROOT/pyproject.toml" | cut -c1-12)"
    if [ ! -f "$stamp" ]; then
        "$PY" -m pip install --quiet -e "$ROOT[dev]"
        touch "$stamp"
    fi
}

wait_until() {  # wait_until SECONDS COMMAND...
    local deadline=$((SECONDS + $1)); shift
    until "$@" >/dev/null 2>&1; do
        if [ "$SECONDS" -ge "$deadline" ]; then return 1; fi
        sleep 0.5
    done
}

ensure_postgres() {
    if pg_isready -h 127.0.0.1 -p 5432 -q 2>/dev/null; then return 0; fi
    echo "starting PostgreSQL" >&2
    pg_ctlcluster --skip-systemctl-redirect "$(ls /etc/postgresql | head -n1)" main start
    wait_until 60 pg_isready -h 127.0.0.1 -p 5432 -q || { echo "PostgreSQL did not start" >&2; return 1; }
}

ensure_redis() {
    if redis-cli -h 127.0.0.1 -p 6379 ping 2>/dev/null | grep -q PONG; then return 0; fi
    echo "starting Redis" >&2
    mkdir -p /var/lib/redis /var/log/redis
    redis-server --daemonize yes --bind 127.0.0.1 -::1 --port 6379 --save "" \
        --appendonly no --dir /var/lib/redis --logfile /var/log/redis/ci.log
    wait_until 30 sh -c 'redis-cli -h 127.0.0.1 -p 6379 ping | grep -q PONG' \
        || { echo "Redis did not start" >&2; return 1; }
}

ensure_rabbitmq() {
    if (exec 3<>/dev/tcp/127.0.0.1/5672) 2>/dev/null; then return 0; fi
    echo "starting RabbitMQ" >&2
    rabbitmq-server -detached
    wait_until 180 bash -c '(exec 3<>/dev/tcp/127.0.0.1/5672)' \
        || { echo "RabbitMQ did not start" >&2; return 1; }
}

ensure_rabbitmq_management() {  # the dashboard reads a queue's oldest message age there
    if (exec 3<>/dev/tcp/127.0.0.1/15672) 2>/dev/null; then return 0; fi
    echo "enabling RabbitMQ's management plugin" >&2
    rabbitmq-plugins enable rabbitmq_management >/dev/null
    wait_until 60 bash -c '(exec 3<>/dev/tcp/127.0.0.1/15672)' \
        || { echo "RabbitMQ's management API did not start" >&2; return 1; }
}

ensure_database() {  # the database the test settings name; pytest-django makes test_<name>
    local name="${PGDATABASE:-explicit}"
    if ! psql -h 127.0.0.1 -U "${PGUSER:-postgres}" -tAc \
            "select 1 from pg_database where datname='$name'" postgres | grep -q 1; then
        createdb -h 127.0.0.1 -U "${PGUSER:-postgres}" "$name"
    fi
}

ensure_chromium() {  # the browser tests drive Debian's chromium through Playwright
    if command -v chromium >/dev/null 2>&1; then return 0; fi
    echo "installing chromium (Debian package) for the browser tests" >&2
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q chromium >/dev/null; } \
        || { echo "could not install chromium" >&2; return 1; }
}
