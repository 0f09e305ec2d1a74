"""The `llmc` command line: compile, inspect, run, eval, serve, bench (a module per kind of command)."""
from __future__ import annotations

import sys

import click

from llmc.errors import LLMCError


class _Group(click.Group):
    """Prints llmc's errors as one line (no traceback) unless --debug is given."""

    def invoke(self, ctx):
        try:
            return super().invoke(ctx)
        except (click.exceptions.Exit, click.exceptions.Abort, click.ClickException):
            raise
        except LLMCError as e:
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: {e}", err=True)
            sys.exit(1)
        except KeyboardInterrupt:
            click.echo("interrupted", err=True)
            sys.exit(130)
        except BrokenPipeError:  # output piped into `head` and the like
            sys.stderr.close()
            sys.exit(0)
        except Exception as e:  # a bug in llmc: still no traceback by default, but say how to get one
            if ctx.obj and ctx.obj.get("debug"):
                raise
            click.echo(f"error: internal error {type(e).__name__}: {e} (rerun as `llmc --debug ...` for the traceback)",
                       err=True)
            sys.exit(2)


@click.group(cls=_Group, context_settings={"help_option_names": ["-h", "--help"]})
@click.option("--debug", is_flag=True, help="Show full tracebacks on errors.")
@click.version_option(package_name="llmc")
@click.pass_context
def main(ctx, debug):
    """llmc: an ahead-of-time compiler and runtime for LLM inference.

    \b
    llmc compile builtin:tiny-py -o tiny.llmc      capture, optimise and save an artifact
    llmc run tiny.llmc --prompt "def add(a, b):"   generate text from an artifact
    llmc inspect tiny.llmc [--ir]                  what an artifact holds
    llmc bench tiny.llmc [--workload decode]       throughput and latency of an artifact
    """
    ctx.ensure_object(dict)["debug"] = debug


# the commands register themselves on `main`
from llmc.cli import artifacts, generation, serving  # noqa: E402,F401
