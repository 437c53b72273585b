"""Package mapping that pyproject.toml cannot express: three source roots, one distribution.

``policies/`` and ``kernels/`` install as ``pcframe.policies`` and ``pcframe.kernels`` and
``conf/`` as ``pcframe.conf`` (the Hydra configs), so no bare top-level name is installed.
"""

from setuptools import find_packages, setup

ROOTS = {"pcframe.policies": "policies", "pcframe.kernels": "kernels"}


def mapped(prefix: str, root: str) -> list[str]:
    return [prefix] + [f"{prefix}.{name}" for name in find_packages(root)]


packages = find_packages(include=["pcframe", "pcframe.*"])
for prefix, root in ROOTS.items():
    packages += mapped(prefix, root)
packages.append("pcframe.conf")

setup(
    packages=packages,
    package_dir={"pcframe": "pcframe", **ROOTS, "pcframe.conf": "conf"},
    package_data={"pcframe.conf": ["**/*.yaml"]},
    include_package_data=True,
)
