"""Real-time ingestion of Kafka topics into indexed datasets (see ``kafka.py``)."""

from fabric.ingest.checkpoint import Checkpoint
from fabric.ingest.kafka import IngestOptions, IngestStats, KafkaIngestor

__all__ = ["Checkpoint", "IngestOptions", "IngestStats", "KafkaIngestor"]
