"""Build the C++ planner extension `megatron_hdp._planner`; metadata lives in pyproject.toml."""

from pybind11.setup_helpers import Pybind11Extension, build_ext
from setuptools import setup

setup(
    ext_modules=[
        Pybind11Extension(
            "megatron_hdp._planner",
            [
                "csrc/planner/attention_spread.cc",
                "csrc/planner/balance.cc",
                "csrc/planner/bindings.cc",
            ],
            include_dirs=["csrc/planner"],
            depends=["csrc/planner/attention_spread.h", "csrc/planner/balance.h"],
            cxx_std=17,
            extra_compile_args=["-O2"],
        )
    ],
    cmdclass={"build_ext": build_ext},
)
