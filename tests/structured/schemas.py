"""JSON schemas the structured-output tests hold the default model to: nested objects, arrays with
bounds, enums, numbers with ranges, patterns, $ref, unions. Each with the prompt that asks for it."""

from __future__ import annotations

SCHEMAS: dict[str, tuple[str, dict]] = {
    "person": (
        "Describe a person as JSON.",
        {
            "type": "object",
            "properties": {
                "name": {"type": "string", "maxLength": 24},
                "age": {"type": "integer", "minimum": 0, "maximum": 120},
                "tags": {"type": "array", "items": {"type": "string", "maxLength": 12}, "minItems": 1, "maxItems": 3},
            },
            "required": ["name", "age", "tags"],
        },
    ),
    "nested_address": (
        "Give the address of a museum as JSON.",
        {
            "type": "object",
            "properties": {
                "museum": {"type": "string", "maxLength": 40},
                "address": {
                    "type": "object",
                    "properties": {
                        "street": {"type": "string", "maxLength": 40},
                        "city": {"type": "string", "maxLength": 24},
                        "zip": {"type": "string", "pattern": "^[0-9]{5}$"},
                    },
                    "required": ["street", "city", "zip"],
                },
            },
            "required": ["museum", "address"],
        },
    ),
    "enum_status": (
        "Report the status of a server as JSON.",
        {
            "type": "object",
            "properties": {
                "status": {"enum": ["active", "inactive", "pending"]},
                "priority": {"type": "string", "enum": ["low", "medium", "high"]},
            },
            "required": ["status", "priority"],
        },
    ),
    "number_ranges": (
        "Give today's weather as JSON.",
        {
            "type": "object",
            "properties": {
                "temperature": {"type": "number", "minimum": -50, "maximum": 60},
                "humidity": {"type": "integer", "minimum": 0, "maximum": 100},
                "wind_kmh": {"type": "number", "exclusiveMinimum": 0, "maximum": 300},
            },
            "required": ["temperature", "humidity", "wind_kmh"],
        },
    ),
    "array_of_objects": (
        "List some products as JSON.",
        {
            "type": "object",
            "properties": {
                "products": {
                    "type": "array",
                    "minItems": 2,
                    "maxItems": 4,
                    "items": {
                        "type": "object",
                        "properties": {
                            "id": {"type": "integer", "minimum": 1, "maximum": 9999},
                            "label": {"type": "string", "maxLength": 20},
                            "price": {"type": "number", "minimum": 0, "maximum": 1000},
                        },
                        "required": ["id", "label", "price"],
                    },
                }
            },
            "required": ["products"],
        },
    ),
    "bool_and_null": (
        "Is the shop open? Answer as JSON.",
        {
            "type": "object",
            "properties": {"open": {"type": "boolean"}, "note": {"type": ["string", "null"], "maxLength": 30}},
            "required": ["open", "note"],
        },
    ),
    "pattern_code": (
        "Give a flight code as JSON.",
        {
            "type": "object",
            "properties": {
                "code": {"type": "string", "pattern": "^[A-Z]{3}-[0-9]{2,4}$"},
                "gate": {"type": "string", "pattern": "^[A-F][1-9]$"},
            },
            "required": ["code", "gate"],
        },
    ),
    "top_level_array": (
        "List a few lucky numbers as a JSON array.",
        {"type": "array", "items": {"type": "integer", "minimum": 0, "maximum": 99}, "minItems": 3, "maxItems": 5},
    ),
    "any_of": (
        "Give a shape as JSON.",
        {
            "anyOf": [
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "circle"},
                        "radius": {"type": "number", "minimum": 0, "maximum": 100},
                    },
                    "required": ["kind", "radius"],
                },
                {
                    "type": "object",
                    "properties": {
                        "kind": {"const": "square"},
                        "side": {"type": "integer", "minimum": 1, "maximum": 100},
                    },
                    "required": ["kind", "side"],
                },
            ]
        },
    ),
    "optional_fields": (
        "Describe a book as JSON.",
        {
            "type": "object",
            "properties": {
                "title": {"type": "string", "maxLength": 40},
                "year": {"type": "integer", "minimum": 1400, "maximum": 2030},
                "isbn": {"type": "string", "pattern": "^[0-9]{10}$"},
            },
            "required": ["title"],
        },
    ),
    "refs": (
        "Describe a team of two as JSON.",
        {
            "$defs": {
                "member": {
                    "type": "object",
                    "properties": {"name": {"type": "string", "maxLength": 20}, "role": {"enum": ["lead", "dev"]}},
                    "required": ["name", "role"],
                }
            },
            "type": "object",
            "properties": {"lead": {"$ref": "#/$defs/member"}, "dev": {"$ref": "#/$defs/member"}},
            "required": ["lead", "dev"],
        },
    ),
    "deep_nesting": (
        "Give a configuration as JSON.",
        {
            "type": "object",
            "properties": {
                "server": {
                    "type": "object",
                    "properties": {
                        "http": {
                            "type": "object",
                            "properties": {
                                "port": {"type": "integer", "minimum": 1, "maximum": 65535},
                                "tls": {
                                    "type": "object",
                                    "properties": {"enabled": {"type": "boolean"}},
                                    "required": ["enabled"],
                                },
                            },
                            "required": ["port", "tls"],
                        }
                    },
                    "required": ["http"],
                }
            },
            "required": ["server"],
        },
    ),
    "string_lengths": (
        "Give a username and a password hint as JSON.",
        {
            "type": "object",
            "properties": {
                "username": {"type": "string", "minLength": 3, "maxLength": 12},
                "hint": {"type": "string", "minLength": 5, "maxLength": 30},
            },
            "required": ["username", "hint"],
        },
    ),
    "integer_array_unique": (
        "List three distinct digits as JSON.",
        {
            "type": "object",
            "properties": {
                "digits": {
                    "type": "array",
                    "items": {"type": "integer", "minimum": 0, "maximum": 9},
                    "minItems": 3,
                    "maxItems": 3,
                }
            },
            "required": ["digits"],
        },
    ),
}

TOOLS = [
    {
        "type": "function",
        "function": {
            "name": "get_weather",
            "description": "Current weather of a city",
            "parameters": {
                "type": "object",
                "properties": {
                    "city": {"type": "string", "maxLength": 30},
                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]},
                },
                "required": ["city", "unit"],
            },
        },
    },
    {
        "type": "function",
        "function": {
            "name": "search_flights",
            "description": "Flights between two airports on a date",
            "parameters": {
                "type": "object",
                "properties": {
                    "origin": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "destination": {"type": "string", "pattern": "^[A-Z]{3}$"},
                    "passengers": {"type": "integer", "minimum": 1, "maximum": 9},
                },
                "required": ["origin", "destination", "passengers"],
            },
        },
    },
]
