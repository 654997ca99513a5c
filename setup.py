"""The optional compiled hot path (otelprof/_timings/_speedups.c); everything else is in
pyproject.toml. Without a C compiler the build goes on and otelprof runs in pure Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "otelprof._timings._speedups",
            ["otelprof/_timings/_speedups.c"],
            depends=["otelprof/_timings/_cpython_compat.h"],
            optional=True,
        )
    ]
)
