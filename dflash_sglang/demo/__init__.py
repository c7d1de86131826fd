"""`dflash-sglang demo`, the README's first command: the SmolLM2 testbed pair decoded plainly and speculatively, timed
side by side, outputs checked identical. Runs after setup, on the user's machine; it drives the product through
bench/ (CPU Engines) or the core reference decoder, on testbed/'s pair and data, so it imports those and nothing
imports it but the command line. main.py: the command and the reference backend; engines.py: the SGLang backend
(the default); words.py: what both say."""
