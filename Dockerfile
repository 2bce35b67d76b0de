# miStudio image: the same code runs as web (Daphne) and worker (manage.py worker).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY requirements.txt .
# Which build of torch 2.13.0: the CPU build by default; the GPU image (docker-compose's worker-gpu)
# passes TORCH_INDEX=https://pypi.org/simple, whose Linux wheel of the same version is the CUDA 13.0
# build, its CUDA libraries as pip packages (so no CUDA base image; the host supplies the driver).
# requirements.txt's torch==2.13.0 is then already satisfied; bitsandbytes ships its CUDA kernels.
ARG TORCH_INDEX=https://download.pytorch.org/whl/cpu
RUN pip install --index-url "$TORCH_INDEX" torch==2.13.0 \
    && pip install -r requirements.txt \
    && python -c "import torch; print('torch', torch.__version__, 'CUDA', torch.version.cuda)"
COPY . .
RUN MISTUDIO_DATA_DIR=/tmp/build-data python manage.py collectstatic --noinput
EXPOSE 8000
CMD ["python", "-m", "mistudio.web_server", "-v", "0", "-b", "0.0.0.0", "-p", "8000", "mistudio.asgi:application"]
