"""Statistics added to the catalogue, a module each: every module here that defines
``STATISTIC`` (an `analysis.stats.statistic.Statistic`, or a tuple of them) is a column of every
statistics table. See `analysis.stats.statistic` for what a declaration holds."""
