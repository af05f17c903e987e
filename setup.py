"""Package discovery for the wheel; everything else is in pyproject.toml.

Packages are found, never listed: ``pivotrl`` and every package under it, and the top-level folders
``tasks/`` and ``flows/`` (with any package under them) installed as ``pivotrl.tasks`` and
``pivotrl.flows``, so the generic names never collide with other packages in site-packages.
"""

from setuptools import find_packages, setup

MAPPED = {"pivotrl.tasks": "tasks", "pivotrl.flows": "flows"}

setup(
    packages=find_packages(include=["pivotrl", "pivotrl.*"])
    + [f"{name}{'.' + sub if sub else ''}" for name, folder in MAPPED.items() for sub in ["", *find_packages(folder)]],
    package_dir=MAPPED,
)
