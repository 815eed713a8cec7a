# The image of a SpotSweep child (docs/sweeps.md, "Image"): an AWS Deep Learning Container (CUDA, cuDNN,
# NCCL and the framework, patched by AWS) plus this project's node-side packages, which run the notice
# watcher beside the user's script (python -m spot_training.agent.sweep_child -- COMMAND).
#
#   aws ecr get-login-password --region us-east-1 | docker login --username AWS --password-stdin 763104351884.dkr.ecr.us-east-1.amazonaws.com
#   docker build -f docker/sweep.Dockerfile -t <account>.dkr.ecr.<region>.amazonaws.com/spot-training-sweep:latest .
#   docker push <account>.dkr.ecr.<region>.amazonaws.com/spot-training-sweep:latest
#
# Pick the DLC of your framework and region (https://github.com/aws/deep-learning-containers/blob/master/available_images.md).
ARG BASE_IMAGE=763104351884.dkr.ecr.us-east-1.amazonaws.com/pytorch-training:2.6.0-gpu-py312-cu126-ubuntu22.04-ec2
FROM ${BASE_IMAGE}
WORKDIR /opt/spot-training
COPY requirements-agent.txt pyproject.toml README.md ./
COPY spot_training/__init__.py spot_training/__init__.py
COPY spot_training/contract spot_training/contract
COPY spot_training/agent spot_training/agent
COPY spot_training/training spot_training/training
RUN python -m pip install --no-cache-dir -r requirements-agent.txt \
 && python -m pip install --no-cache-dir --no-deps . \
 && python -c "import spot_training.agent.sweep_child"
# The user's code: copy it here or clone it in the sweep's command.
WORKDIR /workspace
