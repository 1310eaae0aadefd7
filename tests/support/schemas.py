"""Real-world shaped JSON schemas for the structured-output tests, each with a prompt that
asks for it: nested objects, arrays, enums, optional fields, bounded numbers, patterns."""

from __future__ import annotations

SCHEMAS: dict[str, dict] = {
    "person": {
        "type": "object",
        "properties": {
            "name": {"type": "string", "maxLength": 40},
            "age": {"type": "integer", "minimum": 0, "maximum": 130},
            "email": {"type": "string", "pattern": "^[a-z]{1,12}@[a-z]{1,12}\\.(com|org)$"},
        },
        "required": ["name", "age", "email"],
        "additionalProperties": False,
    },
    "order": {
        "type": "object",
        "properties": {
            "order_id": {"type": "string", "pattern": "^ORD-[0-9]{4}$"},
            "status": {"type": "string", "enum": ["pending", "shipped", "delivered"]},
            "items": {
                "type": "array",
                "minItems": 1,
                "maxItems": 3,
                "items": {
                    "type": "object",
                    "properties": {
                        "sku": {"type": "string", "maxLength": 12},
                        "quantity": {"type": "integer", "minimum": 1, "maximum": 9},
                        "price": {"type": "number", "minimum": 0, "maximum": 1000},
                    },
                    "required": ["sku", "quantity"],
                },
            },
            "gift": {"type": "boolean"},
        },
        "required": ["order_id", "status", "items"],
    },
    "weather": {
        "type": "object",
        "properties": {
            "city": {"type": "string", "maxLength": 30},
            "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
            "forecast": {
                "type": "array",
                "maxItems": 3,
                "items": {"type": "number", "minimum": -50, "maximum": 60},
            },
            "location": {
                "type": "object",
                "properties": {"lat": {"type": "number", "minimum": -90, "maximum": 90},
                               "lon": {"type": "number", "minimum": -180, "maximum": 180}},
                "required": ["lat", "lon"],
            },
        },
        "required": ["city", "unit", "location"],
    },
    "event": {
        "type": "object",
        "properties": {
            "title": {"type": "string", "maxLength": 30},
            "date": {"type": "string", "pattern": "^20[0-9]{2}-[01][0-9]-[0-3][0-9]$"},
            "attendees": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 4},
            "priority": {"enum": [1, 2, 3]},
            "notes": {"type": ["string", "null"], "maxLength": 30},
        },
        "required": ["title", "date", "priority"],
    },
    "sentiment": {
        "type": "object",
        "properties": {
            "label": {"type": "string", "enum": ["positive", "negative", "neutral"]},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "keywords": {"type": "array", "items": {"type": "string", "maxLength": 16}, "maxItems": 3},
        },
        "required": ["label", "score"],
        "additionalProperties": False,
    },
}

PROMPTS: dict[str, str] = {
    "person": "Describe a person as JSON with name, age and email.",
    "order": "Give an online shop order as JSON.",
    "weather": "Give the weather forecast for Paris as JSON.",
    "event": "Describe a team meeting as JSON.",
    "sentiment": "Classify the sentiment of 'I love this phone' as JSON.",
}

REGEX = r"[A-Z][a-z]{2,8} [0-9]{1,3}"
"""A word and a number, e.g. "Paris 42"."""
CHOICES = ["Paris", "London", "Berlin", "Rome"]
