# chatstream worker image: `docker build -t chatstream .`, then `docker run chatstream`
# (CMD: chatstream worker) with CHATSTREAM_* settings in the environment. The same image
# runs every other subcommand: `docker run chatstream chatstream mock-upstream --host 0.0.0.0`.
FROM python:3.11-slim

ENV PYTHONDONTWRITEBYTECODE=1 \
    PYTHONUNBUFFERED=1 \
    PIP_NO_CACHE_DIR=1 \
    PIP_DISABLE_PIP_VERSION_CHECK=1

WORKDIR /app

# Only what the package build needs (pyproject.toml names README.md as the readme).
COPY pyproject.toml README.md ./
COPY schemas ./schemas
COPY worker ./worker
# [fast]: uvloop, hiredis, httptools (prebuilt wheels; the worker logs what it runs on)
RUN pip install '.[fast]' \
    && useradd --system --uid 10001 --no-create-home --shell /usr/sbin/nologin chatstream

USER chatstream

# SIGTERM: stop intake, finish or hand back running jobs within
# CHATSTREAM_SHUTDOWN_GRACE_SECONDS; give the container a longer stop timeout than that.
STOPSIGNAL SIGTERM
CMD ["chatstream", "worker"]
