"""The public pass API: write a pass, register it, put it in the pipeline."""
from llmc.passes.manager import (PASSES, Pass, PassContext, PassManager, PassResult, get_pass,
                                 parse_pass_spec, register_pass)
from llmc.passes.pattern import Builder, Match, P, Pattern, RewritePass, RewriteRule, apply_rewrites, dead_code
from llmc.passes.pipeline import default_passes, pipeline
from llmc.passes.dead_code import DeadCode
from llmc.passes.fold_constants import FoldConstants
from llmc.passes.lift_patterns import LiftPatterns

__all__ = ["PASSES", "Pass", "PassContext", "PassManager", "PassResult", "get_pass", "parse_pass_spec",
           "register_pass", "Builder", "Match", "P", "Pattern", "RewritePass", "RewriteRule", "apply_rewrites", "dead_code",
           "default_passes", "pipeline", "DeadCode", "FoldConstants", "LiftPatterns"]
