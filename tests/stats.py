"""Two-sample homogeneity test shared by the lossless-sampling tests."""

import numpy as np
from scipy import stats as sstats


def homogeneity(samples_a, samples_b, min_count: int = 20):
  """Chi-square test that two samples of hashable outcomes come from one distribution.
  Categories with fewer than min_count samples in all are pooled.
  -> (p-value, number of categories, the 2 x C contingency table)."""
  pa, pb = list(samples_a), list(samples_b)
  cats = sorted(set(pa) | set(pb))
  ca = np.array([pa.count(c) for c in cats])
  cb = np.array([pb.count(c) for c in cats])
  small = (ca + cb) < min_count
  table = np.stack([np.r_[ca[~small], ca[small].sum()], np.r_[cb[~small], cb[small].sum()]])
  table = table[:, table.sum(0) > 0]
  return sstats.chi2_contingency(table)[1], table.shape[1], table
