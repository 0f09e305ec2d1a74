"""`python -m llmc.runtime.distributed SPEC_JSON`: a worker process, started by the driver."""
import sys

from llmc.runtime.distributed.worker import main

main(sys.argv[1:])
