"""The Dagster layer: one module per concern, assembled by tq_pipelines.definitions."""

import warnings

import dagster as dg

# Asset checks, code references, observable source assets and backfill policies are used on
# purpose; Dagster marks them beta or preview, and their warnings would fill the console of every
# process that loads the code location (webserver, daemon, each run).
warnings.filterwarnings("ignore", category=dg.BetaWarning)
warnings.filterwarnings("ignore", category=dg.PreviewWarning)
