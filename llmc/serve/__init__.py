"""`llmc serve`: an OpenAI-compatible HTTP server over one `AsyncLLM` (`llmc.serve.app.create_app`),
and `llmc bench serve`, the client that measures one (`llmc.serve.bench`)."""
