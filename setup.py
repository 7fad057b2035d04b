"""Map the source roots (one per component) into one `shoal` import namespace (pyproject.toml)."""

from setuptools import find_namespace_packages, setup

packages, package_dir = [], {}
for root in ("contract", "engine", "router", "operator", "fetch", "cli", "devcluster",
             "supervisor"):
    for pkg in find_namespace_packages(root, include=["shoal.*"]):
        packages.append(pkg)
        package_dir[pkg] = f"{root}/{pkg.replace('.', '/')}"

# Data files the packages read at run time: CRD and chart inputs, templates, the CPU kernels'
# C sources, the dev cluster's build script.
DATA = ["*.yaml", "*.json", "*.jinja", "*.c", "*.h", "*.sh"]
setup(packages=packages, package_dir=package_dir, package_data={"": DATA})
