"""What the benchmark commands share: flags, results and their files, the machine, the CPU meter, prompts,
ember's timings, the rounds that alternate sides, launched servers, the HTTP load generator, random models.

The library sits under the commands (bench/commands/) and the sides and peers (bench/sides/, bench/peers/):
they import it, it imports none of them.
"""
