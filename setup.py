"""Maps the top-level `kernels/` folder to the import package `dit_accel.kernels`.

A top-level `kernels` package would shadow Hugging Face's `kernels` package, which diffusers
imports for its hub attention backends. Everything else about the build is in pyproject.toml.
"""
from setuptools import find_packages, setup

KERNEL_PACKAGES = ["dit_accel.kernels"] + [f"dit_accel.kernels.{p}" for p in find_packages("kernels")]

setup(
    packages=find_packages(include=["dit_accel", "dit_accel.*"]) + KERNEL_PACKAGES,
    package_dir={"dit_accel.kernels": "kernels"},
)
