"""`ember bench ...`: ember against llama.cpp and transformers, measured in the same runs, written to results files.

cli.py lists the commands (COMMANDS); each lives in commands/. What they share is in lib/; the engines
under test are sides (sides/: ember here or in a worker process) and peers (peers/: llama.cpp,
transformers). Imports go commands -> sides, peers -> lib, never back.
"""
