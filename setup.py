"""Packaging beyond pyproject.toml: conf/ stays at the top of the repository, where users look
for it, and is installed as the package `specheads.conf`, so that the console scripts of an
installed specheads (specheads-train, ...) compose the same configs as the scripts of a checkout.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["specheads", "specheads.*"]), "specheads.conf"],
    package_dir={"specheads.conf": "conf"},
    package_data={
        "specheads.conf": ["*.yaml", "*/*.yaml"],
        "specheads.data": ["*.jsonl"],  # the shipped dev prompt set (dev_questions.jsonl)
    },
)
