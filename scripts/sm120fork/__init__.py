"""sm120fork: the maintenance tool of the sglang-sm120 fork.

One module per concern: `gitcmd` is the only place that runs git, `errors`
holds the one exception root, `cli` maps it to exit codes.
"""
