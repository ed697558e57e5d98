# The router in front of the daemons (deploy/kubernetes/base/router.yaml):
#   docker build -f deploy/kubernetes/router.Dockerfile -t gnosis-router:0.1.17 .
FROM python:3.11-slim
ENV PIP_NO_CACHE_DIR=1 PIP_DISABLE_PIP_VERSION_CHECK=1 PYTHONDONTWRITEBYTECODE=1
RUN pip install vllm-router==0.1.17 \
 && useradd --system --uid 10002 --user-group --no-create-home --shell /usr/sbin/nologin router
USER router
ENTRYPOINT ["vllm-router"]
