"""Builds the gRPC stubs from protos/ before packaging (stubs are generated, never committed)."""

import runpy
from pathlib import Path

from setuptools import setup
from setuptools.command.build_py import build_py


class BuildPyWithProtos(build_py):
    def run(self):
        codegen = runpy.run_path(str(Path(__file__).parent / "shared" / "rpc" / "codegen.py"))
        codegen["generate"]()
        super().run()


setup(cmdclass={"build_py": BuildPyWithProtos})
