"""Package metadata for megafp8."""
from setuptools import find_packages, setup

setup(
    name="megafp8",
    version="0.1.0",
    description="Megatron-style distributed LLM pretraining with DeepSeek-V3-style per-tile FP8",
    long_description=open("README.md", encoding="utf-8").read(),
    long_description_content_type="text/markdown",
    license="Apache-2.0",
    python_requires=">=3.10",
    packages=find_packages(include=["megafp8", "megafp8.*"]),
    package_data={"megafp8": ["py.typed"]},
    install_requires=["torch>=2.11", "numpy>=1.24", "pyyaml>=6.0", "xxhash>=3.0"],
    extras_require={
        "hf": ["tokenizers>=0.19", "safetensors>=0.4"],
        "logging": ["tensorboard>=2.14", "wandb>=0.17"],
        "plot": ["matplotlib>=3.7"],
        # transformers: tests/test_hf_transformers.py checks checkpoint conversion against its models.
        # pytest-xdist: `make test` runs the suite in a worker per core.
        "test": ["pytest>=7.4", "pytest-xdist>=3.5", "tokenizers>=0.19", "tensorboard>=2.14", "wandb>=0.17",
                 "matplotlib>=3.7", "safetensors>=0.4", "transformers>=5"],
    },
)
