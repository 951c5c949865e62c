"""Small files on any filesystem Spark writes (local, HDFS, S3...), through Hadoop's
FileSystem in the driver's JVM: summary.json, the report, the checkpoint's JSON, and
deleting a directory. The Parquet tables are written by Spark itself."""

from __future__ import annotations


def write_text(spark, path: str, text: str) -> None:
    """Write a small file through Hadoop's FileSystem, so DIR can be any URI Spark writes."""
    write_bytes(spark, path, text.encode("utf-8"))


def write_bytes(spark, path: str, data: bytes) -> None:
    jvm = spark.sparkContext._jvm
    target = jvm.org.apache.hadoop.fs.Path(path)
    fs = target.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    stream = fs.create(target, True)
    try:
        stream.write(bytearray(data))
    finally:
        stream.close()


def read_text(spark, path: str, limit: int | None = None) -> str | None:
    """A small file through Hadoop's FileSystem, or None if there is none (or it is larger
    than ``limit`` bytes: not the small file it should be)."""
    jvm = spark.sparkContext._jvm
    target = jvm.org.apache.hadoop.fs.Path(path)
    fs = target.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration())
    if not fs.exists(target) or (limit is not None and fs.getFileStatus(target).getLen() > limit):
        return None
    stream = fs.open(target)
    try:
        reader = jvm.java.io.BufferedReader(jvm.java.io.InputStreamReader(stream, "UTF-8"))
        lines = []
        while (line := reader.readLine()) is not None:
            lines.append(line)
        return "\n".join(lines)
    finally:
        stream.close()


def delete_path(spark, path: str) -> None:
    jvm = spark.sparkContext._jvm
    target = jvm.org.apache.hadoop.fs.Path(path)
    target.getFileSystem(spark.sparkContext._jsc.hadoopConfiguration()).delete(target, True)
