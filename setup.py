"""The package list, which pyproject.toml cannot say: every quantkit package found, plus the
top-level recipes/ folder shipped inside the wheel as quantkit/recipes/.

The recipes live at the top of the repo, where a user looks for one to copy and edit
(`quantkit convert --recipe my.yaml`); an installed quantkit finds them in its own package
(quantkit.recipe.recipe_dirs). Everything else is in pyproject.toml.
"""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["quantkit", "quantkit.*"]), "quantkit.recipes"],
    package_dir={"quantkit.recipes": "recipes"},
)
