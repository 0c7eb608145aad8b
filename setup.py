"""Package metadata for megatron_mhar and its Triton kernels, ``mhar_kernels`` (not
``kernels``: that is Hugging Face's kernel hub package, a dependency of transformers)."""

from setuptools import find_packages, setup

setup(
    name="megatron_mhar",
    version="0.1.0",
    description="Multi-Head Attention Residuals (MHAR) for Megatron-Core GPT models",
    python_requires=">=3.11",
    packages=find_packages(include=["megatron_mhar", "megatron_mhar.*", "mhar_kernels", "mhar_kernels.*"])
    + ["megatron_mhar.recipes"],
    # The recipes live at the top of the checkout (recipes/) and install as the package's
    # data (megatron_mhar/recipes/), so a bare recipe name resolves in any install.
    package_dir={"megatron_mhar.recipes": "recipes"},
    package_data={"megatron_mhar.recipes": ["*.yaml", "base/*.yaml"]},
    include_package_data=True,
    install_requires=[
        "torch>=2.4",
        "megatron-core>=0.16.1,<0.20",
        "numpy",
        "pyyaml",
        "tokenizers",
        "tensorboard",
        "safetensors",
        "psutil",  # Megatron's checkpoint writer needs it (without it a save hangs)
        "xxhash",  # checksums of the checkpoint manifests
        "pillow",  # routing maps (training driver, megatron_mhar.analyze)
    ],
    extras_require={
        "te": ["transformer-engine[pytorch]"],
        # setuptools: tests/test_install.py builds the wheel without build isolation (offline),
        # which needs a setuptools that writes wheels by itself (70.1 and later).
        # lm-eval: lm-evaluation-harness; transformers >= 5.24 for the cache API megatron_mhar.hf uses
        # (MIN_TRANSFORMERS_VERSION in megatron_mhar/hf/configuration_mhar.py).
        "eval": ["lm-eval[hf]>=0.4.13", "transformers>=5.24"],
        "dev": ["pytest", "pytest-xdist", "triton", "transformers>=5.24", "lm-eval[hf]>=0.4.13", "peft", "setuptools>=70.1"],
    },
    entry_points={
        "console_scripts": [
            "mhar-train=megatron_mhar.train:main",
            "mhar-convert=megatron_mhar.conversion.cli:main",
            "mhar-preprocess=megatron_mhar.data.preprocess:main",
        ]
    },
)
