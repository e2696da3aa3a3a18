"""What the benchmark commands share: flags, the one Result and the one Bar they report through and the results
files, the machine, the CPU meter, prompts, ember's timings, figures paired with a peer run by run
(metric.py), the rounds that alternate sides, launched servers, the HTTP load generator, random models.

The library sits under the commands (bench/commands/) and the sides and peers (bench/sides/, bench/peers/):
they import it, it imports none of them.
"""
