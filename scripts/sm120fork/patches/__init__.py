"""The patch series: `series` (patches/series), `patchfile` and `dep3` (one patch
file and its header), `diffs` and `lines` (unified diffs), `normalform` (how a
patch is written back), `applier` and `stack` (applying the series), `checks`
(`sm120fork check`)."""
