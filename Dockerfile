# miStudio image: the same code runs as web (Daphne) and worker (manage.py worker).
FROM python:3.11-slim
ENV PYTHONDONTWRITEBYTECODE=1 PYTHONUNBUFFERED=1 PIP_NO_CACHE_DIR=1
WORKDIR /app
COPY requirements.txt .
# The CPU build of torch; a GPU image installs the CUDA build of the same version instead.
RUN pip install --index-url https://download.pytorch.org/whl/cpu torch==2.13.0 \
    && pip install -r requirements.txt
COPY . .
RUN MISTUDIO_DATA_DIR=/tmp/build-data python manage.py collectstatic --noinput
EXPOSE 8000
CMD ["python", "-m", "mistudio.web_server", "-v", "0", "-b", "0.0.0.0", "-p", "8000", "mistudio.asgi:application"]
