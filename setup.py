"""Builds the gRPC stubs from protos/ before packaging (stubs are generated, never committed)."""

import runpy
from pathlib import Path

from setuptools import find_packages, setup
from setuptools.command.build_py import build_py


class BuildPyWithProtos(build_py):
    def run(self):
        codegen = runpy.run_path(str(Path(__file__).parent / "shared" / "rpc" / "codegen.py"))
        codegen["generate"]()
        # The package list was found before the stubs existed (a clean checkout has none): add their
        # packages, or a built wheel lacks them.
        generated = find_packages(include=["shared.rpc.qserve*"])
        self.packages = list(self.packages or []) + [p for p in generated if p not in (self.packages or [])]
        self.distribution.packages = self.packages
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
