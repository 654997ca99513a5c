"""The optional compiled hot path (otelprof/timings/_speedups.c); everything else is in
pyproject.toml. Without a C compiler the build goes on and otelprof runs in pure Python."""

from setuptools import Extension, setup

setup(
    ext_modules=[
        Extension(
            "otelprof.timings._speedups",
            ["otelprof/timings/_speedups.c"],
            depends=["otelprof/timings/_cpython_compat.h"],
            optional=True,
        )
    ]
)
