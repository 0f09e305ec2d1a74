"""llmc: an ahead-of-time compiler and runtime for LLM inference."""
